"""Kubernetes quantity parsing (common.quantity).

Covers: plain, decimal-suffixed, binary-suffixed and exponent forms for cpu (millicores,
rounded up) and bytes (rounded up); ints and floats; every rejection names the bad value;
the short spellings used in Pending messages.
Leaves out: quantities in pod specs as a whole (the allocator's pod parsing).
"""

from __future__ import annotations

import pytest

from common.quantity import (
    format_bytes,
    format_cpu_millis,
    parse_bytes,
    parse_cpu_millis,
    parse_quantity,
)


@pytest.mark.parametrize(
    ("text", "millis"),
    [
        ("64", 64_000),
        ("500m", 500),
        ("0.5", 500),
        ("1.5", 1500),
        (".25", 250),
        ("1.0005", 1001),  # rounded up, like Quantity.MilliValue()
        ("100u", 1),
        ("2k", 2_000_000),
        ("1e3", 1_000_000),
        ("+3", 3000),
        (" 2 ", 2000),
        (4, 4000),
        (0.25, 250),
    ],
)
def test_cpu(text: str | int | float, millis: int) -> None:
    assert parse_cpu_millis(text) == millis


@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("512Gi", 512 * 2**30),
        ("1G", 10**9),
        ("1.5Gi", 3 * 2**29),
        ("128974848", 128974848),
        ("129e6", 129_000_000),
        ("123Mi", 123 * 2**20),
        ("1Ki", 1024),
        ("100m", 1),  # a tenth of a byte rounds up to one
        ("0", 0),
        ("1Ei", 2**60),
        (4096, 4096),
    ],
)
def test_bytes(text: str | int, n: int) -> None:
    assert parse_bytes(text) == n


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ("", "'' is not a quantity"),
        ("abc", "'abc' is not a quantity"),
        ("1Zi", "'1Zi': unknown quantity suffix 'Zi'"),
        ("1.2.3", "unknown quantity suffix '.3'"),
        ("-1", "'-1' is negative"),
        ("1e99", "exponent out of range"),
        (True, "True is not a quantity"),
        (float("nan"), "nan is not a quantity"),
    ],
)
def test_rejections_name_the_value(bad: str | float, words: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_quantity(bad)
    assert words in str(info.value)


def test_errors_are_value_errors_from_both_parsers() -> None:
    with pytest.raises(ValueError, match="'12x'"):
        parse_cpu_millis("12x")
    with pytest.raises(ValueError, match="'12x'"):
        parse_bytes("12x")


@pytest.mark.parametrize(("millis", "text"), [(4000, "4"), (1500, "1500m"), (0, "0")])
def test_format_cpu(millis: int, text: str) -> None:
    assert format_cpu_millis(millis) == text


@pytest.mark.parametrize(
    ("n", "text"),
    [(512 * 2**30, "512Gi"), (3 * 2**29, "1.5Gi"), (2**20, "1Mi"), (2048, "2Ki"), (100, "100")],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text
