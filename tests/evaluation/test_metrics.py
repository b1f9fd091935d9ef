"""WER / CER with kaldialign on known strings."""

from __future__ import annotations

import random

import kaldialign
import pytest

from asrflow.errors import AsrflowError
from asrflow.evaluation.metrics import EPS, ErrorCounts, align, score_corpus, score_utterance


def test_substitution_and_deletion():
    score = score_corpus({"u1": "A B C D"}, {"u1": "A X C"})
    assert score.words == ErrorCounts(substitutions=1, deletions=1, insertions=0, ref_len=4)
    assert score.wer == 0.5
    row = score.utterances[0]
    assert row.alignment == [("A", "A"), ("B", "X"), ("C", "C"), ("D", EPS)]
    assert row.words.errors == 2
    # Characters: "A B C D" (7) against "A X C": B -> X, then " D" deleted.
    assert score.chars == ErrorCounts(substitutions=1, deletions=2, insertions=0, ref_len=7)
    assert score.cer == pytest.approx(3 / 7)


def test_insertion_and_character_rate():
    score = score_corpus({"u1": "A B"}, {"u1": "A C B"})
    assert score.words == ErrorCounts(0, 0, 1, 2)
    assert score.utterances[0].alignment == [("A", "A"), (EPS, "C"), ("B", "B")]
    assert score.wer == 0.5
    char_score = score_corpus({"u1": "YES NO"}, {"u1": "YES NOT"})
    assert char_score.wer == 0.5
    assert char_score.chars == ErrorCounts(0, 0, 1, 6)


def test_corpus_totals_pool_utterances_and_whitespace_is_normalised():
    refs = {"a": "YES NO YES", "b": "NO NO", "c": "  YES   YES "}
    hyps = {"a": "YES YES", "b": "NO NO", "c": "YES YES"}
    score = score_corpus(refs, hyps)
    assert score.words == ErrorCounts(0, 1, 0, 7)
    assert score.wer == pytest.approx(1 / 7)
    assert [row.id for row in score.utterances] == ["a", "b", "c"]
    assert score.utterances[2].ref == "YES YES"
    assert score.utterances[2].chars.errors == 0


def test_missing_hypothesis_counts_as_deletions_and_extra_ones_are_ignored():
    score = score_corpus({"a": "YES NO", "b": "NO"}, {"b": "NO", "zzz": "YES"})
    assert score.words == ErrorCounts(0, 2, 0, 3)
    assert score.num_missing_hyps == 1
    missing = score.utterances[0]
    assert not missing.has_hyp and missing.hyp == ""
    assert missing.alignment == [("YES", EPS), ("NO", EPS)]


def test_literal_star_is_a_word_not_a_gap():
    alignment, counts = align(["A", "*"], ["A", "*"])
    assert counts.errors == 0
    assert alignment == [("A", "A"), ("*", "*")]


def test_most_frequent_errors():
    refs = {"a": "YES NO YES", "b": "YES NO", "c": "NO"}
    hyps = {"a": "NO NO YES", "b": "NO NO NO", "c": ""}
    score = score_corpus(refs, hyps)
    assert score.most_frequent_errors(10) == [("sub: YES -> NO", 2), ("del: NO", 1), ("ins: NO", 1)]
    assert score.most_frequent_errors(1) == [("sub: YES -> NO", 2)]


def test_counts_match_kaldialign_edit_distance_on_random_texts():
    rng = random.Random(0)
    words = ["YES", "NO", "MAYBE", "A", "B"]
    refs, hyps = {}, {}
    for i in range(50):
        refs[f"u{i}"] = " ".join(rng.choices(words, k=rng.randint(1, 8)))
        hyps[f"u{i}"] = " ".join(rng.choices(words, k=rng.randint(0, 8)))
    score = score_corpus(refs, hyps)
    expected_errors = sum(kaldialign.edit_distance(refs[k].split(), hyps[k].split())["total"] for k in refs)
    assert score.words.errors == expected_errors
    assert score.words.ref_len == sum(len(r.split()) for r in refs.values())
    for row in score.utterances:
        ref_side = [r for r, _ in row.alignment if r != EPS]
        hyp_side = [h for _, h in row.alignment if h != EPS]
        assert ref_side == row.ref.split() and hyp_side == row.hyp.split()


def test_empty_utterance_reference_and_empty_corpus():
    row = score_utterance("x", "", "YES")
    assert row.words == ErrorCounts(0, 0, 1, 0)
    assert row.words.rate == 1.0
    assert score_utterance("y", "", "").words.rate == 0.0
    with pytest.raises(AsrflowError, match="no reference"):
        score_corpus({}, {"a": "YES"})
    with pytest.raises(AsrflowError, match="all empty"):
        score_corpus({"a": " "}, {"a": "YES"})
