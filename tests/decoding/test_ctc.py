"""CTC decoders on hand-built and random log-probabilities, KenLM fusion with tiny ARPA files."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from asrflow.decoding import LMBeamSearchDecoder, build_decoder, greedy_decode, prefix_beam_search
from asrflow.errors import AsrflowError

BLANK = 0
WORD_TOKENS = ["<blk>", "<unk>", "\u2581YES", "\u2581NO"]
CHAR_TOKENS = ["<blk>", "<unk>", "\u2581", "Y", "E", "S", "N", "O"]


def peaked(best: list[int], vocab: int, p: float = 0.9) -> torch.Tensor:
    """``(1, T, vocab)`` log-probs whose frame ``t`` gives ``best[t]`` probability ``p``."""
    probs = torch.full((len(best), vocab), (1 - p) / (vocab - 1))
    probs[torch.arange(len(best)), torch.tensor(best)] = p
    return probs.log().unsqueeze(0)


def from_probs(rows: list[list[float]]) -> torch.Tensor:
    """``(1, T, V)`` log-probs from per-frame probabilities."""
    return torch.tensor(rows, dtype=torch.float64).log().unsqueeze(0)


def sequence_log_prob(log_probs: torch.Tensor, length: int, ids: list[int]) -> float:
    """``log P(ids | log_probs[:length])``, summed over all CTC alignments (natural log)."""
    targets = torch.tensor([ids], dtype=torch.long) if ids else torch.zeros((1, 0), dtype=torch.long)
    loss = F.ctc_loss(
        log_probs[:length].unsqueeze(1).double(),  # (T, 1, V)
        targets,
        torch.tensor([length]),
        torch.tensor([len(ids)]),
        blank=BLANK,
        reduction="sum",
    )
    return -loss.item()


def write_arpa(path: Path, unigrams: dict[str, float], bigrams: dict[tuple[str, str], float] | None = None) -> Path:
    """A hand-written bigram ARPA file; probabilities are log10, backoff weights 0.

    KenLM needs a bigram section, so without ``bigrams`` one bigram repeats the first
    word's unigram probability (a no-op, since backoff weights are 0).
    """
    if not bigrams:
        word = next(w for w in unigrams if w not in ("<s>", "</s>", "<unk>"))
        bigrams = {("<s>", word): unigrams[word]}
    lines = ["\\data\\", f"ngram 1={len(unigrams)}", f"ngram 2={len(bigrams)}", "", "\\1-grams:"]
    lines += [f"{logp}\t{word}" + ("" if word == "</s>" else "\t0") for word, logp in unigrams.items()]
    lines += ["", "\\2-grams:"]
    lines += [f"{logp}\t{a} {b}" for (a, b), logp in bigrams.items()]
    lines += ["", "\\end\\", ""]
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def uniform_lm(path: Path, tokens: list[str]) -> Path:
    pieces = [t for t in tokens if t not in ("<blk>", "<unk>")]
    logp = -math.log10(len(pieces) + 1)
    return write_arpa(path, {"<s>": -99.0, "</s>": logp, "<unk>": -99.0, **{p: logp for p in pieces}})


# ---------------------------------------------------------------------------- greedy


def test_greedy_collapses_repeats_and_keeps_repeats_separated_by_blank():
    log_probs = peaked([1, 1, 0, 1, 2, 2, 0, 0, 3, 3], vocab=4)
    assert greedy_decode(log_probs, torch.tensor([10])) == [[1, 1, 2, 3]]


def test_greedy_all_blank_gives_empty_output():
    assert greedy_decode(peaked([0] * 6, vocab=4), torch.tensor([6])) == [[]]


def test_greedy_respects_lengths_and_other_blank_ids():
    first = peaked([1, 2, 2, 3, 3, 1], vocab=4)
    second = peaked([3, 0, 3, 0, 1, 1], vocab=4)
    batch = torch.cat([first, second])  # (2, 6, 4)
    assert greedy_decode(batch, torch.tensor([3, 6])) == [[1, 2], [3, 3, 1]]
    assert greedy_decode(batch, torch.tensor([0, 2])) == [[], [3]]
    # With blank = 3 the frames of token 3 separate and vanish instead.
    assert greedy_decode(batch, torch.tensor([6, 6]), blank=3) == [[1, 2, 1], [0, 0, 1]]


def test_decoders_reject_bad_shapes():
    with pytest.raises(ValueError, match=r"\(N, T, V\)"):
        greedy_decode(torch.zeros(4, 3), torch.tensor([4]))
    with pytest.raises(ValueError, match="lengths"):
        prefix_beam_search(torch.zeros(2, 4, 3), torch.tensor([4]), beam_size=2)


# ---------------------------------------------------------------------------- prefix beam search


@pytest.mark.parametrize("beam_size", [1, 2, 4])
def test_beam_known_answers(beam_size):
    batch = torch.cat(
        [
            peaked([1, 1, 0, 1, 2, 2, 0, 0, 3, 3], vocab=4),
            peaked([0] * 10, vocab=4),
            peaked([2, 0, 2, 3, 3, 3, 3, 3, 3, 3], vocab=4),
        ]
    )
    lengths = torch.tensor([10, 10, 3])
    assert prefix_beam_search(batch, lengths, beam_size) == [[1, 1, 2, 3], [], [2, 2]]


def test_beam_finds_the_sequence_greedy_misses():
    # Each frame alone prefers blank (0.6), but "a" sums three alignments (a a, a _, _ a)
    # to 0.64 > 0.36 for the empty output.
    log_probs = from_probs([[0.6, 0.4], [0.6, 0.4]])
    lengths = torch.tensor([2])
    assert greedy_decode(log_probs, lengths) == [[]]
    assert prefix_beam_search(log_probs, lengths, beam_size=2) == [[1]]
    assert math.isclose(sequence_log_prob(log_probs[0], 2, [1]), math.log(0.64), rel_tol=1e-9)


def test_beam_never_worse_than_greedy_on_random_posteriors():
    # Peaky random posteriors, like a trained CTC model's (on near-uniform ones a
    # narrow beam can prune the greedy prefix away).
    gen = torch.Generator().manual_seed(0)
    num_utts, num_frames, vocab = 48, 30, 8
    log_probs = (5 * torch.randn(num_utts, num_frames, vocab, generator=gen)).log_softmax(-1)
    lengths = torch.randint(1, num_frames + 1, (num_utts,), generator=gen)
    greedy = greedy_decode(log_probs, lengths)
    beam = prefix_beam_search(log_probs, lengths, beam_size=8)
    strictly_better = 0
    for n in range(num_utts):
        length = int(lengths[n])
        beam_score = sequence_log_prob(log_probs[n], length, beam[n])
        greedy_score = sequence_log_prob(log_probs[n], length, greedy[n])
        assert beam_score >= greedy_score - 1e-9, n
        strictly_better += beam_score > greedy_score + 1e-9
    assert strictly_better > 0


def test_beam_batch_equals_one_by_one_and_ignores_padding():
    gen = torch.Generator().manual_seed(1)
    log_probs = (4 * torch.randn(3, 12, 5, generator=gen)).log_softmax(-1)
    lengths = torch.tensor([12, 7, 0])
    batch = prefix_beam_search(log_probs, lengths, beam_size=4)
    for n in range(3):
        length = int(lengths[n])
        alone = prefix_beam_search(log_probs[n : n + 1, :length], torch.tensor([length]), beam_size=4)
        assert batch[n] == alone[0]
    assert batch[2] == []


# ---------------------------------------------------------------------------- KenLM fusion


def one_word_of_two() -> torch.Tensor:
    """Three frames: blank, then ``▁NO`` (0.5) slightly ahead of ``▁YES`` (0.4), then blank."""
    return from_probs(
        [
            [0.97, 0.01, 0.01, 0.01],
            [0.09, 0.01, 0.40, 0.50],
            [0.97, 0.01, 0.01, 0.01],
        ]
    ).float()


def test_flashlight_loads_a_tiny_arpa_and_returns_valid_tokens(tmp_path):
    lm = uniform_lm(tmp_path / "chars.arpa", CHAR_TOKENS)
    decoder = LMBeamSearchDecoder(CHAR_TOKENS, BLANK, beam_size=8, lm_path=lm, lm_weight=0.5)
    gen = torch.Generator().manual_seed(2)
    log_probs = (3 * torch.randn(4, 20, len(CHAR_TOKENS), generator=gen)).log_softmax(-1)
    lengths = torch.tensor([20, 13, 1, 0])
    hyps = decoder(log_probs, lengths)
    assert len(hyps) == 4
    assert hyps[3] == []
    for hyp, length in zip(hyps, lengths.tolist(), strict=True):
        assert all(0 < token < len(CHAR_TOKENS) for token in hyp)
        assert len(hyp) <= length


def test_lm_decoder_keeps_every_emitted_token_including_leading_word_boundary(tmp_path):
    # "▁ Y E S ▁ N O", each frame followed by a blank: the first ▁ must survive too.
    frames = [2, 0, 3, 0, 4, 0, 5, 0, 2, 0, 6, 0, 7, 0]
    log_probs = peaked(frames, vocab=len(CHAR_TOKENS), p=0.95)
    lm = uniform_lm(tmp_path / "chars.arpa", CHAR_TOKENS)
    decoder = LMBeamSearchDecoder(CHAR_TOKENS, BLANK, beam_size=8, lm_path=lm, lm_weight=0.0)
    assert decoder(log_probs, torch.tensor([len(frames)])) == [[2, 3, 4, 5, 2, 6, 7]]


def test_lm_favouring_a_word_changes_the_output(tmp_path):
    log_probs, lengths = one_word_of_two(), torch.tensor([3])
    lm = write_arpa(
        tmp_path / "yes.arpa",
        {"<s>": -99.0, "</s>": -0.1, "<unk>": -99.0, "\u2581YES": -0.05, "\u2581NO": -4.0},
    )
    assert greedy_decode(log_probs, lengths) == [[3]]
    assert prefix_beam_search(log_probs, lengths, beam_size=4) == [[3]]
    without = LMBeamSearchDecoder(WORD_TOKENS, BLANK, beam_size=4, lm_path=lm, lm_weight=0.0)
    assert without(log_probs, lengths) == [[3]]
    with_lm = LMBeamSearchDecoder(WORD_TOKENS, BLANK, beam_size=4, lm_path=lm, lm_weight=1.0)
    assert with_lm(log_probs, lengths) == [[2]]


def test_lm_bigram_context_matters(tmp_path):
    # Two words; the second frame is ambiguous. "YES NO" is a likely bigram, "YES YES" is not.
    log_probs = from_probs(
        [
            [0.02, 0.01, 0.95, 0.02],
            [0.96, 0.01, 0.02, 0.01],
            [0.10, 0.01, 0.45, 0.44],
            [0.97, 0.01, 0.01, 0.01],
        ]
    ).float()
    lm = write_arpa(
        tmp_path / "bigram.arpa",
        {"<s>": -99.0, "</s>": -1.0, "<unk>": -99.0, "\u2581YES": -0.5, "\u2581NO": -0.5},
        {("<s>", "\u2581YES"): -0.1, ("\u2581YES", "\u2581NO"): -0.1, ("\u2581YES", "\u2581YES"): -3.0},
    )
    decoder = LMBeamSearchDecoder(WORD_TOKENS, BLANK, beam_size=4, lm_path=lm, lm_weight=1.0)
    assert prefix_beam_search(log_probs, torch.tensor([4]), beam_size=4) == [[2, 2]]
    assert decoder(log_probs, torch.tensor([4])) == [[2, 3]]


def test_word_score_adds_or_removes_words(tmp_path):
    # "▁YES" is clear; a faint "▁NO" (0.3 against blank's 0.66) follows.
    log_probs = from_probs(
        [
            [0.02, 0.01, 0.95, 0.02],
            [0.96, 0.01, 0.02, 0.01],
            [0.66, 0.01, 0.03, 0.30],
            [0.97, 0.01, 0.01, 0.01],
        ]
    ).float()
    lengths = torch.tensor([4])
    lm = uniform_lm(tmp_path / "words.arpa", WORD_TOKENS)
    results = {
        score: LMBeamSearchDecoder(WORD_TOKENS, BLANK, beam_size=4, lm_path=lm, lm_weight=0.0, word_score=score)(
            log_probs, lengths
        )
        for score in (0.0, 3.0, -10.0)
    }
    assert results == {0.0: [[2]], 3.0: [[2, 3]], -10.0: [[]]}


def test_lm_decoder_reports_missing_or_corrupt_files(tmp_path):
    with pytest.raises(AsrflowError, match="does not exist"):
        LMBeamSearchDecoder(WORD_TOKENS, BLANK, beam_size=4, lm_path=tmp_path / "nope.arpa", lm_weight=1.0)
    bad = tmp_path / "bad.arpa"
    bad.write_text("this is not an ARPA file\n")
    with pytest.raises(AsrflowError, match="could not be loaded"):
        LMBeamSearchDecoder(WORD_TOKENS, BLANK, beam_size=4, lm_path=bad, lm_weight=1.0)


# ---------------------------------------------------------------------------- factory


def test_build_decoder_picks_the_decoder(tmp_path):
    log_probs, lengths = one_word_of_two(), torch.tensor([3])
    lm = write_arpa(
        tmp_path / "yes.arpa",
        {"<s>": -99.0, "</s>": -0.1, "<unk>": -99.0, "\u2581YES": -0.05, "\u2581NO": -4.0},
    )
    kwargs = dict(tokens=WORD_TOKENS, blank=BLANK, beam_size=4, lm_weight=1.0, word_score=0.0)
    assert build_decoder("greedy", lm_path=str(lm), **kwargs)(log_probs, lengths) == [[3]]
    assert build_decoder("beam", lm_path=None, **kwargs)(log_probs, lengths) == [[3]]
    assert build_decoder("beam", lm_path=str(lm), **kwargs)(log_probs, lengths) == [[2]]
    two = from_probs([[0.6, 0.01, 0.38, 0.01], [0.6, 0.01, 0.38, 0.01]])
    assert build_decoder("greedy", lm_path=None, **kwargs)(two, torch.tensor([2])) == [[]]
    assert build_decoder("beam", lm_path=None, **kwargs)(two, torch.tensor([2])) == [[2]]


def test_build_decoder_rejects_bad_settings(tmp_path):
    kwargs = dict(tokens=WORD_TOKENS, blank=BLANK, lm_weight=1.0, word_score=0.0)
    with pytest.raises(AsrflowError, match="'viterbi' is not a decoder"):
        build_decoder("viterbi", beam_size=4, lm_path=None, **kwargs)
    with pytest.raises(AsrflowError, match="beam_size"):
        build_decoder("beam", beam_size=0, lm_path=None, **kwargs)
    with pytest.raises(AsrflowError, match="missing.arpa"):
        build_decoder("beam", beam_size=4, lm_path=str(tmp_path / "missing.arpa"), **kwargs)
