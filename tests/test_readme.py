"""The README stays a short user guide, and every relative link in it and in docs/ resolves (file and anchor)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README_MAX_LINES = 350
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def outside_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def prose(text: str) -> str:
    """The text outside code blocks and inline code (links there are examples, not links)."""
    return re.sub(r"`[^`\n]*`", "", outside_fences(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped, spaces -> -."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in outside_fences(path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def dead_links(path: Path) -> list[str]:
    dead = []
    for target in LINK.findall(prose(path.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            dead.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            dead.append(f"{target} (no heading with that anchor)")
    return dead


def test_readme_is_a_short_guide():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_relative_links_in_readme_and_docs_resolve():
    dead = {str(p.relative_to(REPO)): d for p in documents() if (d := dead_links(p))}
    assert not dead, dead


def test_the_link_check_finds_a_dead_file_and_a_dead_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Real heading (`--flag`)\n\nsee [b](b.md), [c](#real-heading---flag), [d](#gone)\n"
                                   "```\n[not a link](nowhere.md)\n```\n")
    assert dead_links(tmp_path / "a.md") == ["b.md (no such file)", "#gone (no heading with that anchor)"]
