"""Every relative link and image in README.md and docs/*.md points at a file that exists, and
every `#anchor` at a heading of its page (GitHub's heading ids), so a README that moves
sections around (issue 31) cannot leave a newcomer a dead link or a missing picture."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# [text](target) and ![alt](target); a target never holds spaces or parentheses here
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(h) for h in HEADING.findall(FENCE.sub("", page.read_text()))}


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no file {file.relative_to(root)})")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target} (no heading #{anchor} in {file.relative_to(root)})")
    return broken


def test_every_link_and_image_in_the_docs_exists():
    broken = {p.relative_to(ROOT).as_posix(): b for p in _pages() if (b := broken_links(p))}
    assert not broken, broken


def test_the_link_check_catches_a_missing_file_and_heading(tmp_path):
    (tmp_path / "there.md").write_text("# Getting started: the `make run` demo\n")
    page = tmp_path / "page.md"
    page.write_text(
        "![a](there.md) [b](there.md#getting-started-the-make-run-demo) [c](https://x.org/y)\n"
        "[d](gone.png) [e](there.md#nowhere) [f](#here)\n## Here\n"
        "```\n[g](inside-a-fence.md)\n```\n"
    )
    assert broken_links(page, tmp_path) == [
        "gone.png (no file gone.png)",
        "there.md#nowhere (no heading #nowhere in there.md)",
    ]
