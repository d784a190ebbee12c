"""Kubernetes resource quantities ("64", "500m", "512Gi", "1G", "1e3") as exact integers.

The grammar is apimachinery's `resource.Quantity`: a signed decimal number, then either a
binary suffix (Ki Mi Gi Ti Pi Ei), a decimal suffix (n u m "" k M G T P E) or a decimal
exponent (`e3`, `E-2`). Values are parsed with `Fraction`, so "0.1" is exactly a tenth, and
rounded up like `Quantity.MilliValue()` / `Value()` do: "1.5m" cpu is 2 millicores, "100m"
bytes is 1 byte. Negative quantities are refused: a request or an allocatable amount below
zero is always a mistake. Every error is a `ValueError` naming the bad value.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_NUMBER = re.compile(r"^(?P<num>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(?P<suffix>.*)$")
_EXPONENT = re.compile(r"^[eE](?P<exp>[+-]?[0-9]+)$")

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}


def parse_quantity(value: str | int | float) -> Fraction:
    """The exact value of a Kubernetes quantity (no rounding)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a quantity")
    if isinstance(value, int):
        result = Fraction(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not a quantity")
        result = Fraction(str(value))
    else:
        text = value.strip()
        m = _NUMBER.match(text)
        if m is None:
            raise ValueError(f"{value!r} is not a quantity (expected e.g. 500m, 64, 512Gi, 1G)")
        number = Fraction(m["num"])
        suffix = m["suffix"]
        if suffix in _BINARY:
            result = number * _BINARY[suffix]
        elif suffix in _DECIMAL:
            result = number * _DECIMAL[suffix]
        elif (e := _EXPONENT.match(suffix)) is not None:
            exp = int(e["exp"])
            if abs(exp) > 30:
                raise ValueError(f"{value!r}: exponent out of range")
            result = number * Fraction(10) ** exp
        else:
            raise ValueError(f"{value!r}: unknown quantity suffix {suffix!r}")
    if result < 0:
        raise ValueError(f"{value!r} is negative; resource quantities must be >= 0")
    return result


def parse_cpu_millis(value: str | int | float) -> int:
    """CPU in millicores, rounded up: "2" → 2000, "500m" → 500, "0.25" → 250."""
    return math.ceil(parse_quantity(value) * 1000)


def parse_bytes(value: str | int | float) -> int:
    """Bytes, rounded up: "512Gi" → 549755813888, "1G" → 1000000000."""
    return math.ceil(parse_quantity(value))


def format_cpu_millis(millis: int) -> str:
    """2000 → "2", 1500 → "1500m" (the shortest exact spelling)."""
    return str(millis // 1000) if millis % 1000 == 0 else f"{millis}m"


def format_bytes(n: int) -> str:
    """A short human spelling: 549755813888 → "512Gi", 1500000000 → "1.4Gi", 100 → "100"."""
    for suffix, unit in (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20)):
        if n >= unit:
            if n % unit == 0:
                return f"{n // unit}{suffix}"
            return f"{n / unit:.1f}{suffix}"
    if n >= 2**10 and n % 2**10 == 0:
        return f"{n // 2**10}Ki"
    return str(n)
