"""The docs say what the code does: flags, links.

Covers: docs/configuration.md's flag tables against the two daemons' argparse parsers (every
documented flag exists, every flag is documented, documented defaults equal the parsers');
every relative link in README.md and docs/*.md resolves to a file in the repository (and, for
`#anchors` into our own Markdown, to a heading); no doc points at files that are not shipped.
Leaves out: prose accuracy, external links (no network).
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest

from nodeagent.main import build_parser as agent_parser
from webhook.main import build_parser as webhook_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PARSERS = {"instaslice-webhook": webhook_parser, "instaslice-nodeagent": agent_parser}


def flag_rows(command: str) -> dict[str, tuple[str, ...]]:
    """`first flag -> (all flags of the row, default cell)` from the table in the section
    `## \\`<command>\\` ...` of docs/configuration.md."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    m = re.search(rf"^## `{re.escape(command)}`.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"docs/configuration.md has no section for {command}"
    rows: dict[str, tuple[str, ...]] = {}
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`--"):
            continue
        flags = tuple(re.findall(r"`(--[a-z][a-z0-9-]*)", cells[0]))
        flags += tuple(re.findall(r"spelling `(--[a-z][a-z0-9-]*)`", cells[0]))
        rows[flags[0]] = (*flags, cells[1])
    return rows


def parser_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        a.option_strings[0]: a
        for a in parser._actions
        if a.option_strings and a.option_strings[0] not in ("-h", "--help")
    }


def _default_spellings(default: object) -> set[str]:
    if isinstance(default, float) and default.is_integer():
        return {str(default), str(int(default))}
    return {str(default)}


@pytest.mark.parametrize("command", PARSERS)
def test_every_flag_is_documented_and_every_documented_flag_exists(command: str) -> None:
    rows = flag_rows(command)
    actions = parser_flags(PARSERS[command]())
    documented = {f for row in rows.values() for f in row[:-1]}
    real = {f for a in actions.values() for f in a.option_strings}
    assert documented - real == set(), f"{command}: documented but no such flag"
    assert real - documented == set(), f"{command}: flags missing from docs/configuration.md"
    for first, action in actions.items():
        row = next(r for r in rows.values() if first in r[:-1])
        assert set(action.option_strings) <= set(row[:-1]), f"{first}: aliases in one row"


@pytest.mark.parametrize("command", PARSERS)
def test_documented_defaults_are_the_parsers(command: str) -> None:
    rows = flag_rows(command)
    for first, action in parser_flags(PARSERS[command]()).items():
        default = action.default
        if default is None or isinstance(default, bool):
            continue  # "none"/"off" or computed at run time (documented in words)
        cell = next(r for r in rows.values() if first in r[:-1])[-1]
        shown = set(re.findall(r"`([^`]*)`", cell))
        assert shown & _default_spellings(default), f"{first}: default {default!r}, doc {cell!r}"


def test_flag_table_parser_sees_a_wrong_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: the old, wrong spelling of the certificate flag is caught."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    bad = text.replace("`--cert-file FILE`", "`--tls-cert-file FILE`")
    assert bad != text
    real_read = Path.read_text
    monkeypatch.setattr(
        Path, "read_text", lambda self, *a, **k: bad if self.name == "configuration.md"
        else real_read(self, *a, **k),
    )  # fmt: skip
    with pytest.raises(AssertionError, match="documented but no such flag"):
        test_every_flag_is_documented_and_every_documented_flag_exists("instaslice-webhook")


# --- links ---------------------------------------------------------------------------------------

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(md: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    out = set()
    for line in md.read_text().splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            title = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower().replace("`", ""))
            out.add(title.replace(" ", "-"))
    return out


@pytest.mark.parametrize("doc", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(doc: Path) -> None:
    for target in _LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        assert dest.exists(), f"{doc.name}: link to missing {target}"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{doc.name}: no heading #{anchor} in {dest.name}"


@pytest.mark.parametrize("doc", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_docs_cite_only_shipped_documents(doc: Path) -> None:
    """CONTRACT.md, STYLE.md and mig.md were working notes outside the repository."""
    text = doc.read_text()
    for name in ("CONTRACT.md", "STYLE.md", "mig.md"):
        for m in re.finditer(rf"(?<![\w/.-]){re.escape(name)}", text):
            raise AssertionError(f"{doc.name} cites {name}: {text[m.start() - 40 : m.end()]!r}")


# Files a maintainer who clones the repository does not have: the working notes the repo's
# docs were made from (docs/contract.md, docs/style.md and docs/mig-facts.md are their copies).
_OUTSIDE = re.compile(r"(?<![\w/.-])(?:CONTRACT\.md|STYLE\.md|mig\.md)|(?<![\w.-])shared/")
_CITED_DOC = re.compile(r"(?<![\w/.-])docs/([\w.-]+\.md)")


def _tracked_sources() -> list[Path]:
    """Code, manifests, charts and data git tracks (not the CHANGELOG, which is history)."""
    suffixes = {".py", ".yaml", ".yml", ".json", ".sh", ".toml", ".tpl", ".txt", ".md", ".cfg"}
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split("\0")
    out = []
    for name in filter(None, names):
        path = ROOT / name
        if path.name == "CHANGELOG.md" or "results" in path.parts or not path.is_file():
            continue
        if path.suffix in suffixes or path.name == "Makefile":
            out.append(path)
    return out


def test_code_cites_only_files_of_the_repository() -> None:
    """Comments, docstrings and data cite docs/*.md that exist, never files outside the repo."""
    bad = []
    for path in _tracked_sources():
        if path == Path(__file__):
            continue
        text = path.read_text(errors="replace")
        for m in _OUTSIDE.finditer(text):
            bad.append(f"{path.relative_to(ROOT)}: {text[max(0, m.start() - 30) : m.end()]!r}")
        for m in _CITED_DOC.finditer(text):
            if not (ROOT / "docs" / m.group(1)).exists():
                bad.append(f"{path.relative_to(ROOT)}: cites missing docs/{m.group(1)}")
    assert not bad, "\n".join(bad)


def test_metrics_doc_says_once_what_a_standby_exports() -> None:
    """docs/metrics.md said both that a standby exports the allocator's model gauges without
    samples and that a replica which lost the Lease keeps exporting its last values. The code
    does the first (StateCollector's source is None off the Lease; `term()` resets it)."""
    from webhook.allocator.metrics import StateCollector

    families = list(StateCollector().collect())
    assert families and all(not f.samples for f in families)
    text = " ".join((ROOT / "docs" / "metrics.md").read_text().split())
    assert "a standby exports the names without samples" in text
    assert "keeps exporting its last" not in text
