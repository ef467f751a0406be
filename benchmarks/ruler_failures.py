"""How each RULER configuration fails on the single-needle tasks: the answers sorted into right, the needle with some
of its tokens missing, another value, or no value at all, read from sweep result files (no model is run).

    python benchmarks/ruler_failures.py docs/results/ruler/smollm2_4k.json \
        docs/results/ruler/smollm2_4k_agnostic_scorers.json

"Needle, tokens missing": a wrong answer holding a value of two or more characters whose characters all appear, in
order, in a reference (" 8092." for 8090293: the cache kept some of the needle's digits, one token each on SmolLM2,
and lost others). "Another value": a value that is no such part of a reference (a distractor, a number of the
haystack, a made-up one). A method whose wrong answers are mostly the first kind finds the needle and loses its
tokens; one whose answers are mostly the second lost the needle. Counts are over the answers the files hold for each
(method, mode, budget); a configuration in several files is counted from the first.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1")  # one needle, one reference
KINDS = ("right", "needle, tokens missing", "another value", "no value")


def in_order(part: str, whole: str) -> bool:
    """Whether the characters of `part` appear in `whole` in the same order."""
    rest = iter(whole)
    return all(char in rest for char in part)


def kind(row: dict) -> str:
    """Which of `KINDS` a single-needle answer is."""
    if row["score"] >= 100:
        return KINDS[0]
    pattern = r"[0-9a-f]{4,}(?:-[0-9a-f]+)*" if row["task"] == "niah_single_3" else r"\d+"  # uuids, numbers
    values = [v.replace("-", "") for v in re.findall(pattern, row["answer"])]
    if not values:
        return KINDS[3]
    references = [r.replace("-", "") for r in row["references"]]
    if any(len(v) >= 2 and v not in references and in_order(v, r) for v in values for r in references):
        return KINDS[1]
    return KINDS[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="`kvsieve ruler` result files")
    args = parser.parse_args()
    counts: dict[tuple, Counter] = {}
    for path in args.files:
        mine: dict[tuple, Counter] = {}
        for row in json.loads(path.read_text())["rows"]:
            if row["task"] in TASKS:
                key = (row["mode"], row["method"], row["budget"])
                mine.setdefault(key, Counter())[kind(row)] += 1
        counts.update({key: value for key, value in mine.items() if key not in counts})
    print("| mode | method | budget | answers | " + " | ".join(KINDS) + " |")
    print("|---|---|---|---|" + "---|" * len(KINDS))
    for (mode, method, budget), found in sorted(counts.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 1)):
        total = sum(found.values())
        shares = " | ".join(f"{100 * found[k] / total:.0f}%" for k in KINDS)
        print(f"| {mode} | {method} | {'-' if budget is None else budget} | {total} | {shares} |")


if __name__ == "__main__":
    main()
