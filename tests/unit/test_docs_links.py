"""The documentation points at things that exist: every relative link in README.md and docs/*.md
(and its #anchor, GitHub's heading slugs), every repository file a document names in backticks, and
every module it names by file name alone (design.md once named a module that had been removed)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# a repository path in backticks: a top-level folder of this repository, then a file name
TOPS = ("common", "device", "edge", "bench", "testbed", "tests", "deploy", "proto", "drafter_build", "docs")
NAMED_FILE = re.compile(r"`((?:%s)/[\w./-]+\.(?:py|md|json|ya?ml|proto|sh|txt|png|csv))`" % "|".join(TOPS))
MODULE = re.compile(r"`([\w-]+\.py)`")  # a module by its file name alone (`session.py`)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but "-" and "_" dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


def _broken(doc: Path) -> list[str]:
    out = []
    text = doc.read_text()
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            out.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            out.append(f"{target}: no heading with that anchor")
    out += [f"`{name}`: no such file" for name in NAMED_FILE.findall(text) if not (ROOT / name).exists()]
    modules = {p.name for top in TOPS for p in (ROOT / top).rglob("*.py")} | {p.name for p in ROOT.glob("*.py")}
    out += [f"`{name}`: no module of that name" for name in MODULE.findall(text) if name not in modules]
    return out


def test_slugs_follow_github() -> None:
    assert _slug("Mode auto: the device picks every round") == "mode-auto-the-device-picks-every-round"
    assert _slug("Same seed, same tokens") == "same-seed-same-tokens"
    assert _slug("DSSD: the residual without the whole p_j") == "dssd-the-residual-without-the-whole-p_j"
    assert _slug("Recorded cellular links (`make bench-traces`)") == "recorded-cellular-links-make-bench-traces"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_named_file_exists(doc) -> None:
    assert not _broken(doc), f"{doc.relative_to(ROOT)}: " + "; ".join(_broken(doc))
