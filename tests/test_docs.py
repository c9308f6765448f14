"""README is read in five minutes and every page it points to is there: README.md stays short, every
relative link in README.md and docs/*.md resolves (file and heading), and the project's own text (docs,
notebooks, the package, the tests, the scripts) speaks of the course, not of its tickets or branches."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
README_LINES = 200


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lstrip("#").strip().lower())
    return text.replace(" ", "-")


def broken_links(page: Path) -> list[str]:
    """``page: target`` for each relative link of ``page`` whose file or heading does not exist."""
    out = []
    name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto: are outside the repository
            continue
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            out.append(f"{name}: {target} (no such file)")
        elif frag and dest.suffix == ".md":
            headings = {anchor(h) for h in re.findall(r"^#+ .*$", dest.read_text(), re.M)}
            if frag not in headings:
                out.append(f"{name}: {target} (no such heading)")
    return out


def test_readme_is_short_and_starts_with_the_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines; move detail to a page in docs/"
    first_screen = "\n".join(lines[:45])
    assert "teraflops run" in first_screen and "pytest -n 2" in first_screen


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_resolves(page):
    assert not broken_links(page)


def test_a_broken_link_is_caught(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# Title here\n[ok](a.md#title-here) [gone](b.md) [bad](a.md#nope) [web](https://x.org)\n"
                    "```\n[in code](nowhere.md)\n```\n")
    assert broken_links(page) == ["a.md: b.md (no such file)", "a.md: a.md#nope (no such heading)"]


# a ticket number ("issue 25", "issue item 5"), a branch marker ("--- i30-demo", "i28-ray") in product text
TICKET = re.compile(r"\bissue (item )?\d+\b|\bi\d{2}-[a-z]+\b|---\s*/?i\d+", re.I)


def ticket_talk(text: str) -> list[str]:
    return [m.group(0) for m in TICKET.finditer(text)]


PRODUCT = [*PAGES, *sorted((ROOT / "notebooks").glob("*.ipynb")), *sorted((ROOT / "solutions").glob("*.ipynb")),
           *sorted((ROOT / "labs").glob("*.ipynb")), *sorted((ROOT / "helpers" / "teraflops").rglob("*.py")),
           *sorted(p for p in (ROOT / "tests").glob("*.py") if p.name != "test_docs.py"),
           *sorted((ROOT / "scripts").glob("*")), ROOT / "conftest.py", ROOT / "pyproject.toml", ROOT / ".ci" / "run"]


def test_the_course_speaks_of_itself():
    found = [f"{p.relative_to(ROOT)}: {t}" for p in PRODUCT if p.is_file() for t in ticket_talk(p.read_text())]
    assert not found, "say why in the project's own words, not by ticket or branch:\n" + "\n".join(found)


def test_ticket_talk_is_caught():
    assert ticket_talk("no torch older was tested (issue 25)") == ["issue 25"]
    assert ticket_talk("# --- i30-demo: presets ---") and ticket_talk("branch i28-ray")
    assert not ticket_talk("pytorch issue #122476 and pytest-xdist issue #1386 are upstream")
