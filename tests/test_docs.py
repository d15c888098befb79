"""The README and docs/ stay walkable: every relative link reaches a file (and a heading, when it
names one), the README stays a front page (300 lines at most), and docs/configuration.md's table
has a row for every setting."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvserve.config import Settings

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '#' in a code block is no heading
    return {_anchor(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _relative_links(page: Path) -> list[str]:
    return [target for target in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_reach_a_file_and_heading(page: Path) -> None:
    broken = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no such heading")
    assert not broken, broken


def test_readme_is_a_front_page_of_at_most_300_lines() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_configuration_table_has_every_setting() -> None:
    rows = [line for line in CONFIGURATION.read_text().splitlines() if line.startswith("| `--")]
    missing = []
    for name in Settings.model_fields:
        flag, env = f"--{name.replace('_', '-')}", f"KVSERVE_{name.upper()}"
        if not any(f"`{flag}" in row and f"`{env}`" in row for row in rows):
            missing.append(flag)
    assert not missing, missing
