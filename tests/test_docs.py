"""Every relative link in README.md and docs/ resolves: the file exists and, where the link names a heading, the file
has that heading (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but `-` and `_`), spaces to `-`."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    result = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = anchor(heading)
        count = seen.get(base, 0)
        result.add(base if count == 0 else f"{base}-{count}")  # repeated headings get -1, -2, ...
        seen[base] = count + 1
    return result


def links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    return [t for t in LINK.findall(text) if not t.startswith(("http://", "https://", "mailto:"))]


def broken(path: Path) -> list[str]:
    problems = []
    for target in links(path):
        file, _, fragment = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            problems.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            problems.append(f"{target}: no heading with that anchor")
    return problems


def test_every_relative_link_resolves():
    problems = {str(p.relative_to(ROOT)): broken(p) for p in documents()}
    problems = {name: found for name, found in problems.items() if found}
    assert not problems, "broken links:\n" + "\n".join(f"{n}: {found}" for n, found in problems.items())


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Title\n\n## What `kvsieve` does: the rule\n")
    page.write_text(
        "[ok](other.md#what-kvsieve-does-the-rule) [gone](missing.md) [bad](other.md#nope) [self](#here)\n"
        "```\n[in code](nowhere.md)\n```\n## Here\n"
    )
    assert broken(page) == ["missing.md: no such file", "other.md#nope: no heading with that anchor"]


def linked_files() -> set[Path]:
    """Every file a page links (README.md and every page under docs/)."""
    return {(page.parent / target.partition("#")[0]).resolve() for page in documents() for target in links(page)}


def test_every_figure_under_docs_is_shown_on_a_page():
    figures = [p for p in (ROOT / "docs").rglob("*") if p.suffix in (".png", ".svg", ".jpg")]
    unlinked = sorted(str(p.relative_to(ROOT)) for p in figures if p.resolve() not in linked_files())
    assert figures and not unlinked, f"figures no page links (link them, or remove them): {unlinked}"


def test_every_result_file_is_in_the_results_index():
    """docs/results/README.md (benchmarks/results_index.py) lists every result file, with its command."""
    folder = ROOT / "docs" / "results"
    index = folder / "README.md"
    listed = {(folder / target).resolve() for target in links(index)}
    files = {p.resolve() for p in folder.rglob("*") if p.is_file() and p != index}
    missing = sorted(str(p.relative_to(ROOT)) for p in files - listed)
    assert not missing, (
        f"result files missing from docs/results/README.md (python benchmarks/results_index.py): {missing}"
    )
