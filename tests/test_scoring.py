"""Offline answer scoring, checked against values worked out by hand."""

from __future__ import annotations

import pytest

from kvsieve.eval.grading import contains, rouge1_recall

SANDWICH = "eat a sandwich and sit in Dolores Park on a sunny day"  # 12 words, "a" twice


@pytest.mark.parametrize(
    ("answer", "reference", "expected"),
    [
        (SANDWICH, SANDWICH, 1.0),
        ("The best thing is to eat a sandwich and sit in Dolores Park on a sunny day.", SANDWICH, 1.0),
        ("Eat a sandwich.", SANDWICH, 3 / 12),  # eat, a, sandwich
        ("a sunny day in the park", SANDWICH, 5 / 12),  # a, sunny, day, in, park ("the" is not in the reference)
        ("Go to the beach.", SANDWICH, 0.0),
        ("", SANDWICH, 0.0),
        ("DOLORES, park!", "Dolores Park", 1.0),  # case and punctuation are ignored
        ("a b", "a a b", 2 / 3),  # each answer word counts once: the second "a" is a miss
        ("a a a b", "a a b", 1.0),
        ("b", "a a b", 1 / 3),
        ("The pass key is 12345.", "12345", 1.0),
        ("The pass key is 12346.", "12345", 0.0),
        ("anything", "", 0.0),  # an empty reference scores nothing
        ("...", "!!!", 0.0),
    ],
)
def test_rouge1_recall(answer, reference, expected):
    assert rouge1_recall(answer, reference) == pytest.approx(expected)


def test_rouge1_recall_is_not_symmetric():
    # Recall of the reference's words: extra answer words do not lower it, missing ones do.
    assert rouge1_recall("eat a sandwich now please", "eat a sandwich") == 1.0
    assert rouge1_recall("eat a sandwich", "eat a sandwich now please") == pytest.approx(3 / 5)


@pytest.mark.parametrize(
    ("answer", "reference", "expected"),
    [
        (SANDWICH, SANDWICH, True),
        ("You should EAT a sandwich, and sit in Dolores-Park on a  sunny day!", SANDWICH, True),
        ("The pass key is 12345.", "12345", True),
        ("12345", "The 12345", False),
        ("eat a sandwich", SANDWICH, False),  # partial answer
        ("eat a sandwich and sit in the park", SANDWICH, False),
        ("The pass key is 54321.", "12345", False),
        ("1234 5", "12345", False),  # spacing inside a word matters
        ("12 345", "12 345", True),
        ("", "12345", False),
    ],
)
def test_contains(answer, reference, expected):
    assert contains(answer, reference) is expected


def test_contains_matches_whole_words_only():
    assert not contains("The pass key is 123456.", "12345")
    assert not contains("concatenate", "cat")
    assert not contains("anything", "")
    assert contains("The pass key is 12345.", "12345")
