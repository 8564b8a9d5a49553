"""Every relative link in README.md and docs/ resolves inside the repository, so a clone with
nothing beside it (or the repository on a forge) has no dead links."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md",
        *sorted((ROOT / "docs").rglob("*.md"))]
# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:


def relative_links(text: str) -> list[str]:
    targets = [m.group(1) for m in LINK.finditer(re.sub(r"```.*?```", "", text, flags=re.S))]
    return [t for t in targets if not EXTERNAL.match(t) and not t.startswith("#")]


def test_the_link_pattern_finds_links_and_images() -> None:
    text = "see [a](docs/a.md#x) and ![plot](img/p.png) not [b](https://x.org) ```[c](d.md)```"
    assert relative_links(text) == ["docs/a.md#x", "img/p.png"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(doc: Path) -> None:
    broken = []
    for target in relative_links(doc.read_text(encoding="utf-8")):
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links outside the repository or to nothing: " \
        f"{broken}"
