"""Grading answers offline: ROUGE-1 recall against the reference and exact substring (the probes, the demo)."""

from __future__ import annotations

import re


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def rouge1_recall(answer: str, reference: str) -> float:
    """Fraction of the reference's words (with multiplicity) that the answer contains."""
    ref = _words(reference)
    if not ref:
        return 0.0
    pool = _words(answer)
    hits = 0
    for word in ref:
        if word in pool:
            pool.remove(word)
            hits += 1
    return hits / len(ref)


def contains(answer: str, reference: str) -> bool:
    """Whether the reference's words appear in the answer as whole words, in order.

    Case, punctuation and spacing are ignored; "123456" does not contain "12345".
    """
    ref = _words(reference)
    return bool(ref) and f" {' '.join(ref)} " in f" {' '.join(_words(answer))} "
