"""Word and character error rates with kaldialign (Levenshtein alignment in C++).

Texts are compared as given, split on whitespace: normalisation (case, punctuation)
is the ``prepare`` stage's job and already applied to both sides. Characters are those of
the words joined by single spaces, so a wrong word boundary counts as a character error
(jiwer's convention). Rates are fractions of the reference length (0.25 = 25 %).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import kaldialign

from asrflow.errors import AsrflowError

#: Marks the missing side of an insertion or deletion in an alignment.
EPS = "*"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ErrorCounts:
    """Edit operations between a reference and a hypothesis, in words or characters."""

    substitutions: int = 0
    deletions: int = 0
    insertions: int = 0
    ref_len: int = 0

    @property
    def errors(self) -> int:
        """Substitutions + deletions + insertions."""
        return self.substitutions + self.deletions + self.insertions

    @property
    def rate(self) -> float:
        """``errors / ref_len`` as a fraction.

        An empty reference (``ref_len == 0``) gives 0 without errors, else the error
        count, as if the reference had one word.
        """
        if self.ref_len == 0:
            return 0.0 if self.errors == 0 else float(self.errors)
        return self.errors / self.ref_len

    def __add__(self, other: ErrorCounts) -> ErrorCounts:
        return ErrorCounts(
            self.substitutions + other.substitutions,
            self.deletions + other.deletions,
            self.insertions + other.insertions,
            self.ref_len + other.ref_len,
        )


@dataclass(frozen=True, kw_only=True)
class UtteranceScore:
    """One utterance: its texts, error counts and word alignment.

    ``alignment`` pairs reference and hypothesis words; :data:`EPS` stands for the
    missing word of a deletion ``(word, "*")`` or an insertion ``("*", word)``.
    """

    id: str
    ref: str
    hyp: str
    words: ErrorCounts
    chars: ErrorCounts
    alignment: list[tuple[str, str]]
    has_hyp: bool = True


@dataclass(frozen=True)
class CorpusScore:
    """Corpus totals (``words``, ``chars``) and the per-utterance rows, in reference order."""

    words: ErrorCounts
    chars: ErrorCounts
    utterances: list[UtteranceScore] = field(default_factory=list)

    @property
    def wer(self) -> float:
        """Word error rate, a fraction."""
        return self.words.rate

    @property
    def cer(self) -> float:
        """Character error rate, a fraction."""
        return self.chars.rate

    @property
    def num_missing_hyps(self) -> int:
        """References that had no hypothesis (scored as all deletions)."""
        return sum(not row.has_hyp for row in self.utterances)

    def most_frequent_errors(self, top_n: int = 20) -> list[tuple[str, int]]:
        """The ``top_n`` commonest word errors as ``("sub: A -> B" | "del: A" | "ins: B", count)``.

        Sorted by count (highest first), then by text.
        """
        counts: Counter[str] = Counter()
        for row in self.utterances:
            counts.update(error_labels(row.alignment))
        return top_errors(counts, top_n)


def error_labels(alignment: Iterable[tuple[str, str]]) -> Iterator[str]:
    """The word errors of an alignment as ``"sub: A -> B"``, ``"del: A"`` or ``"ins: B"``, in order."""
    for ref, hyp in alignment:
        if ref == hyp:
            continue
        if hyp == EPS:
            yield f"del: {ref}"
        elif ref == EPS:
            yield f"ins: {hyp}"
        else:
            yield f"sub: {ref} -> {hyp}"


def top_errors(counts: Counter[str], top_n: int) -> list[tuple[str, int]]:
    """The ``top_n`` commonest of ``counts`` (:func:`error_labels` -> count): by count, highest first, then by text."""
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:top_n]


def align(ref: Sequence[str], hyp: Sequence[str]) -> tuple[list[tuple[str, str]], ErrorCounts]:
    """Minimum-edit alignment of two symbol sequences and its error counts.

    Symbols are aligned as integer ids, so a literal ``"*"`` in the text is not mistaken
    for the gap; the returned pairs use :data:`EPS` for gaps.
    """
    vocab: dict[str, int] = {}
    ref_ids = [vocab.setdefault(symbol, len(vocab)) for symbol in ref]
    hyp_ids = [vocab.setdefault(symbol, len(vocab)) for symbol in hyp]
    symbols = list(vocab)
    pairs = kaldialign.align(ref_ids, hyp_ids, -1)
    sub = dele = ins = 0
    alignment = []
    for r, h in pairs:
        if r == -1:
            ins += 1
        elif h == -1:
            dele += 1
        elif r != h:
            sub += 1
        alignment.append((EPS if r == -1 else symbols[r], EPS if h == -1 else symbols[h]))
    return alignment, ErrorCounts(sub, dele, ins, len(ref))


def score_utterance(utt_id: str, ref: str, hyp: str | None) -> UtteranceScore:
    """Score one hypothesis (``None``: missing, all deletions) against its reference."""
    ref_words = ref.split()
    hyp_words = (hyp or "").split()
    alignment, words = align(ref_words, hyp_words)
    _, chars = align(list(" ".join(ref_words)), list(" ".join(hyp_words)))
    return UtteranceScore(
        id=utt_id,
        ref=" ".join(ref_words),
        hyp=" ".join(hyp_words),
        words=words,
        chars=chars,
        alignment=alignment,
        has_hyp=hyp is not None,
    )


def score_corpus(refs: dict[str, str], hyps: dict[str, str]) -> CorpusScore:
    """WER and CER of ``hyps`` against ``refs`` (both keyed by utterance id).

    A reference without a hypothesis counts as all deletions; hypotheses without a
    reference are ignored (with a warning).

    Raises:
        AsrflowError: when the references hold no words to score against.
    """
    if not refs:
        raise AsrflowError("there are no reference transcripts to score: is the test split empty?")
    extra = set(hyps) - set(refs)
    if extra:
        logger.warning("ignoring %d hypotheses without a reference, e.g. %s", len(extra), min(extra))
    rows = [score_utterance(utt_id, ref, hyps.get(utt_id)) for utt_id, ref in refs.items()]
    missing = sum(not row.has_hyp for row in rows)
    if missing:
        logger.warning("%d of %d utterances have no hypothesis; scored as all deletions", missing, len(rows))
    words = sum((row.words for row in rows), ErrorCounts())
    chars = sum((row.chars for row in rows), ErrorCounts())
    if words.ref_len == 0:
        raise AsrflowError("the reference transcripts are all empty: there are no words to score against")
    return CorpusScore(words=words, chars=chars, utterances=rows)


def pool_scores(scores: Iterable[CorpusScore]) -> CorpusScore:
    """Several scored test sets as one: errors and reference lengths summed, rows in the given order.

    The pooled WER is all word errors over all reference words (not a mean of the sets' WERs).
    """
    scores = list(scores)
    return CorpusScore(
        words=sum((score.words for score in scores), ErrorCounts()),
        chars=sum((score.chars for score in scores), ErrorCounts()),
        utterances=[row for score in scores for row in score.utterances],
    )
