"""Every relative link in README.md and docs/ resolves: the file exists and, where the link names a heading, the file
has that heading (GitHub's anchors)."""

from __future__ import annotations

import functools
import re
import warnings
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


# --- The commands the pages write, against the real parser ------------------------------------------------------

FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`(kvsieve [^`\n]+)`")


def written_commands(path: Path) -> list[tuple[str, bool]]:
    """Every `kvsieve ...` command `path` writes, with whether it is whole: the lines of its code blocks (joined over
    trailing backslashes, comments and a trailing `&` dropped) are whole commands; inline `kvsieve ...` spans in the
    prose may abbreviate (`kvsieve report --ruler`), while those in a table's command column (the results index) are
    whole."""
    text = path.read_text(encoding="utf-8")
    found: list[tuple[str, bool]] = []
    for block in FENCED.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("kvsieve "):
                found.append((line, True))
    prose = FENCED.sub("", text)
    for line in prose.splitlines():
        whole = line.startswith("| [") and path.name == "README.md" and path.parent.name == "results"
        found += [(span, whole) for span in INLINE.findall(line)]
    return found


@functools.cache
def one_parser():
    """The command line's parser, built once (every build reads the registry for each command's epilog: 0.2 s)."""
    from kvsieve.cli import build_parser

    return build_parser()


def command_problem(command: str, whole: bool) -> str | None:
    """What is wrong with one written command (None: nothing). Every subcommand and option must exist in the parser;
    a whole command must parse, and its methods and --set fields must be the registry's."""
    import shlex

    from kvsieve.cli import options
    from kvsieve.errors import KvsieveError

    tokens = shlex.split(command, comments=True)[1:]
    tokens = tokens[: tokens.index("&")] if "&" in tokens else tokens
    for cut in ("|", "&&", ";", ">"):
        tokens = tokens[: tokens.index(cut)] if cut in tokens else tokens
    parser = one_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    if not tokens or tokens[0] not in commands:
        return f"no subcommand {tokens[0] if tokens else ''!r}"
    known = commands[tokens[0]]._option_string_actions
    unknown = [t.split("=")[0] for t in tokens[1:] if t.startswith("-") and t.split("=")[0] not in known]
    if unknown and not all(t.lstrip("-").replace(".", "").isdigit() for t in unknown):
        return f"no option {', '.join(unknown)} on kvsieve {tokens[0]}"
    if not whole:
        return None
    try:
        args = parser.parse_args(tokens)
    except SystemExit:
        return "does not parse"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # a renamed field: the docs must write today's name
            if hasattr(args, "methods") and isinstance(args.methods, str):
                options.specs_of(args)
            elif hasattr(args, "method"):
                options.spec_of(args)
    except (KvsieveError, FutureWarning) as error:
        return str(error)
    return None


def test_every_written_kvsieve_command_exists_in_the_parser(capsys):
    problems = []
    for page in documents():
        for command, whole in written_commands(page):
            problem = command_problem(command, whole)
            capsys.readouterr()  # argparse's own message; the problem says it shorter
            if problem:
                problems.append(f"{page.relative_to(ROOT)}: {command[:120]}: {problem}")
    assert not problems, "commands the docs write that the CLI does not take:\n" + "\n".join(problems)


def test_the_command_checker_finds_an_unknown_subcommand_option_and_field(tmp_path, capsys):
    page = tmp_path / "page.md"
    page.write_text(
        "Run `kvsieve report --ruler` (abbreviated) or `kvsieve frobnicate`.\n```bash\n"
        "kvsieve generate -c doc.txt -q hi --method gemfilter \\\n  --set select.k=64   # fine\n"
        "kvsieve bench --budget 512\nkvsieve niah --methods snapkv --set compress.nope=1\n"
        "kvsieve serve --port 8000 &\n```\n"
    )
    found = [(command, command_problem(command, whole)) for command, whole in written_commands(page)]
    capsys.readouterr()
    problems = [problem for _, problem in found]
    assert problems[0] is None and problems[3] is None  # the generate line (joined) and serve
    assert problems[1] == "no option --budget on kvsieve bench"
    assert "has the field 'compress.nope'" in problems[2]
    assert problems[4] is None and problems[5] == "no subcommand 'frobnicate'"


# --- Paths the pages name ------------------------------------------------------------------------------------------

PATH = re.compile(r"(?<![\w:/.-])((?:src|benchmarks|tests|docs|\.ci)/[\w./*{},-]*[\w*}])")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def named_paths(path: Path) -> set[str]:
    """Repository paths a page names in code (inline spans and code blocks): src/..., benchmarks/..., tests/...,
    docs/..., .ci/... Not names of files that must exist now: a path after `COMMIT:` or on a line that names a
    commit (a file as it was then), and globs."""
    text = path.read_text(encoding="utf-8")
    code = "\n".join([*FENCED.findall(text), *re.findall(r"`([^`\n]+)`", FENCED.sub("", text))])
    current = "\n".join(line for line in code.splitlines() if not COMMIT.search(line))
    return {p for p in PATH.findall(current) if not set(p) & set("*{}")}


def test_every_path_a_page_names_exists():
    missing = [
        f"{page.relative_to(ROOT)}: {name}"
        for page in documents()
        for name in sorted(named_paths(page))
        if not (ROOT / name).exists() and not (ROOT / name).with_suffix("").exists()
    ]
    assert not missing, "paths the docs name that are not in the repository:\n" + "\n".join(missing)


def test_the_path_checker_finds_a_removed_script(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "`benchmarks/needle_grid.py` ran it; `python benchmarks/old.py  # ran at 0c1506f`; `docs/results/c_*.json`\n"
    )
    assert named_paths(page) == {"benchmarks/needle_grid.py"}


def test_result_pages_name_no_folder_of_the_machine_that_ran_them():
    """The results index and every RESULTS.md give commands a reader runs from the repository root: no absolute
    folder of the machine that ran them, no session's runs/sNN folder (records.runnable_command rewrites them)."""
    pages = [ROOT / "docs" / "results" / "README.md", *(ROOT / "docs").rglob("RESULTS.md")]
    local = re.compile(r"(?<![\w.])(/work/|/tmp/|/root/|/home/|runs/s\d+/)")
    found = [f"{page.relative_to(ROOT)}: {m.group(0)}" for page in pages for m in local.finditer(page.read_text())]
    assert len(pages) >= 5 and not found, found
