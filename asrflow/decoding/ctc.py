"""CTC decoders: greedy, prefix beam search, and beam search fused with a KenLM n-gram.

Every decoder takes the acoustic model's output as ``log_probs`` of shape ``(N, T, V)``
(natural-log posteriors over the ``V`` tokens, blank included, for ``T`` frames of ``N``
utterances) and ``lengths`` of shape ``(N,)`` (valid frames per utterance; frames past
it are padding and ignored). It returns one list of token ids per utterance, with
blanks removed and repeats collapsed, ready for :meth:`asrflow.tokenizer.Tokenizer.decode`.

The LM-fused decoder is torchaudio's ``ctc_decoder`` (flashlight-text) in lexicon-free
mode. Lexicon-free means the n-gram scores *tokens*, not words: the ARPA/binary file must
be trained on text encoded with the same tokenizer, one sentence per line, pieces
separated by spaces (for the char tokenizer: ``▁ Y E S ▁ N O``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from asrflow.errors import AsrflowError, require_extra

#: SentencePiece's word-boundary mark: a piece starting with it begins a word.
WORD_BOUNDARY = "\u2581"

#: A batch decoder: ``(log_probs (N, T, V), lengths (N,)) -> token ids per utterance``.
Decoder = Callable[[Tensor, Tensor], list[list[int]]]

DECODER_KINDS = ("greedy", "beam")

_NEG_INF = float("-inf")


def _check_inputs(log_probs: Tensor, lengths: Tensor, blank: int) -> Tensor:
    """Validate shapes; return ``lengths`` as a CPU int64 tensor clipped to ``[0, T]``."""
    if log_probs.dim() != 3:
        raise ValueError(f"log_probs must have shape (N, T, V), got {tuple(log_probs.shape)}")
    num_utts, num_frames, vocab = log_probs.shape
    if lengths.dim() != 1 or lengths.shape[0] != num_utts:
        raise ValueError(f"lengths must have shape ({num_utts},), got {tuple(lengths.shape)}")
    if not 0 <= blank < vocab:
        raise ValueError(f"blank id {blank} is outside the vocabulary of {vocab} tokens")
    return lengths.detach().to("cpu", torch.int64).clamp(0, num_frames)


def greedy_decode(log_probs: Tensor, lengths: Tensor, blank: int = 0) -> list[list[int]]:
    """Best token per frame, repeats collapsed, blanks dropped.

    Args:
        log_probs: ``(N, T, V)`` log-posteriors (any float dtype, any device).
        lengths: ``(N,)`` number of valid frames per utterance.
        blank: id of the CTC blank.

    Returns:
        ``N`` lists of token ids.
    """
    lengths = _check_inputs(log_probs, lengths, blank)
    best = log_probs.detach().argmax(dim=-1).cpu()  # (N, T)
    keep = best != blank  # (N, T)
    keep[:, 1:] &= best[:, 1:] != best[:, :-1]
    keep &= torch.arange(best.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    return [row[mask].tolist() for row, mask in zip(best, keep, strict=True)]


def _log_add(a: float, b: float) -> float:
    """``log(exp(a) + exp(b))`` for Python floats, exact for ``-inf``."""
    if a < b:
        a, b = b, a
    if b == _NEG_INF:
        return a
    return a + math.log1p(math.exp(b - a))


def _prefix_beam_search_one(log_probs: Tensor, beam_size: int, blank: int, token_beam: float) -> list[int]:
    """Prefix beam search over one utterance's ``log_probs`` ``(T, V)``.

    Prefixes live in a tree: node 0 is the empty prefix; ``parent[k]`` and ``token[k]``
    give node ``k``'s last token, ``children[(k, c)]`` its extension by ``c``. Each beam
    entry keeps two log-probabilities: all paths of the prefix ending in blank (``pb``)
    and ending in its last token (``pnb``).
    """
    parent = [-1]
    token = [-1]
    children: dict[tuple[int, int], int] = {}

    def extend(node: int, c: int) -> int:
        child = children.get((node, c))
        if child is None:
            child = len(parent)
            parent.append(node)
            token.append(c)
            children[(node, c)] = child
        return child

    beams: dict[int, tuple[float, float]] = {0: (0.0, _NEG_INF)}
    # Per-frame pruning: the top_k tokens, best first, within token_beam of the best.
    top_k = min(log_probs.shape[-1], max(beam_size, 2))
    top_values, top_tokens = log_probs.topk(top_k, dim=-1)  # (T, top_k), (T, top_k)
    for values, tokens in zip(top_values.tolist(), top_tokens.tolist(), strict=True):
        floor = values[0] - token_beam
        candidates = [(c, p) for c, p in zip(tokens, values, strict=True) if p >= floor]

        nxt: dict[int, list[float]] = {}
        for node, (pb, pnb) in beams.items():
            total = _log_add(pb, pnb)
            last = token[node]
            for c, p in candidates:
                if c == blank:
                    entry = nxt.setdefault(node, [_NEG_INF, _NEG_INF])
                    entry[0] = _log_add(entry[0], total + p)
                    continue
                child = extend(node, c)
                entry = nxt.setdefault(child, [_NEG_INF, _NEG_INF])
                if c == last:
                    # A repeat is a new token only after a blank; otherwise it stays.
                    entry[1] = _log_add(entry[1], pb + p)
                    same = nxt.setdefault(node, [_NEG_INF, _NEG_INF])
                    same[1] = _log_add(same[1], pnb + p)
                else:
                    entry[1] = _log_add(entry[1], total + p)
        kept = heapq.nlargest(beam_size, nxt.items(), key=lambda item: _log_add(*item[1]))
        beams = {node: (pb, pnb) for node, (pb, pnb) in kept}

    best = max(beams.items(), key=lambda item: _log_add(*item[1]))[0]
    ids: list[int] = []
    while best > 0:
        ids.append(token[best])
        best = parent[best]
    return ids[::-1]


def prefix_beam_search(
    log_probs: Tensor, lengths: Tensor, beam_size: int, *, blank: int = 0, token_beam: float = 10.0
) -> list[list[int]]:
    """CTC prefix beam search without a language model.

    Keeps the ``beam_size`` most probable label prefixes, each with the summed
    probability of all its alignments (ending in blank / in its last token), merging
    alignments that collapse to the same prefix. Per frame only the ``max(beam_size, 2)``
    best tokens within ``token_beam`` (natural log) of the frame's best are expanded.

    The batch is decoded one utterance after another, in Python. That is deliberate: the
    search is exact prefix beam search (each prefix's probability sums all of its
    alignments), which torchaudio's C++ ``ctc_decoder`` (flashlight-text) does not do
    without an LM: it scores a hypothesis by its best alignment (Viterbi) and so can rank
    prefixes differently (two frames with P(blank) = 0.6: it returns the empty output,
    0.36, where the exact search returns the one token, 0.64). The work per frame is
    small (``beam_size`` prefixes times at most ``max(beam_size, 2)`` tokens), so next to
    the encoder's matrix products it adds little (bench/RESULTS.md#decode-rtf).
    Utterances are independent, so a caller that needs more speed can split a batch
    across processes.

    Args:
        log_probs: ``(N, T, V)`` log-posteriors.
        lengths: ``(N,)`` number of valid frames per utterance.
        beam_size: prefixes kept per frame (1 gives a greedy-like search).
        blank: id of the CTC blank.
        token_beam: per-frame pruning threshold in nats.

    Returns:
        ``N`` lists of token ids, the most probable prefix of each utterance.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    lengths = _check_inputs(log_probs, lengths, blank)
    frames = log_probs.detach().to("cpu", torch.float64)  # (N, T, V)
    return [
        _prefix_beam_search_one(frames[n, : int(lengths[n])], beam_size, blank, token_beam)
        for n in range(frames.shape[0])
    ]


class LMBeamSearchDecoder:
    """Beam search fused with a token-level KenLM n-gram (torchaudio / flashlight-text).

    Hypothesis score = acoustic log-prob (natural log, best alignment) + ``lm_weight`` *
    LM log10-prob (KenLM's unit, ``</s>`` included) + ``word_score`` per word started (a
    token whose piece begins with ``▁``). Flashlight's lexicon-free decoder has no
    word-insertion score of its own, so a non-zero ``word_score`` wraps the KenLM model
    in a small Python LM that adds it (slower: one Python call per LM query).

    The decoder's silence token is the blank: each hypothesis starts and ends in it, so
    the output is exactly the emitted tokens and the LM scores every one of them,
    leading ``▁`` included, as it does on the encoded training text.
    """

    def __init__(
        self,
        tokens: list[str],
        blank: int,
        *,
        beam_size: int,
        lm_path: str | Path,
        lm_weight: float,
        word_score: float = 0.0,
        beam_threshold: float = 50.0,
    ):
        require_extra("flashlight.lib.text.decoder", "lm", "beam search with a language model (evaluate.lm_path)")
        from torchaudio.models.decoder import ctc_decoder

        lm_path = Path(lm_path)
        if not lm_path.is_file():
            raise AsrflowError(
                f"language model {str(lm_path)!r} does not exist: set evaluate.lm_path in params.yaml "
                "to a KenLM ARPA or binary file, or to null for decoding without an LM"
            )
        if len(set(tokens)) != len(tokens):
            raise AsrflowError("the token list has duplicate pieces: retrain the tokenizer")
        if not 0 <= blank < len(tokens):
            raise AsrflowError(f"blank id {blank} is outside the token list of {len(tokens)} pieces")
        if beam_size < 1:
            raise AsrflowError(f"params.yaml: evaluate.beam_size = {beam_size}; use 1 or more")
        self.tokens = list(tokens)
        self.blank = blank
        options = dict(
            lexicon=None,
            tokens=self.tokens,
            nbest=1,
            beam_size=beam_size,
            beam_threshold=beam_threshold,
            blank_token=self.tokens[blank],
            sil_token=self.tokens[blank],
            sil_score=0.0,
        )
        try:
            kenlm = _load_kenlm(lm_path, self.tokens)
        except RuntimeError as error:
            raise AsrflowError(
                f"language model {str(lm_path)!r} could not be loaded (is it a KenLM ARPA or binary "
                f"file?): {str(error).strip().splitlines()[-1]}"
            ) from None
        if word_score == 0.0:
            self._decoder = ctc_decoder(lm=kenlm, lm_weight=lm_weight, **options)
        else:
            word_starts = {i for i, piece in enumerate(self.tokens) if piece.startswith(WORD_BOUNDARY)}
            lm = _word_bonus_lm(kenlm, lm_weight, word_score, word_starts)
            self._decoder = ctc_decoder(lm=lm, lm_weight=1.0, **options)

    def __call__(self, log_probs: Tensor, lengths: Tensor) -> list[list[int]]:
        """Decode ``log_probs`` ``(N, T, V)`` with ``lengths`` ``(N,)``; see the module docstring."""
        if log_probs.dim() == 3 and log_probs.shape[-1] != len(self.tokens):
            raise ValueError(f"log_probs has {log_probs.shape[-1]} classes but there are {len(self.tokens)} tokens")
        lengths = _check_inputs(log_probs, lengths, self.blank)
        emissions = log_probs.detach().to("cpu", torch.float32).contiguous()  # (N, T, V)
        hypotheses = self._decoder(emissions, lengths)
        return [[int(i) for i in hyps[0].tokens.tolist()] if hyps else [] for hyps in hypotheses]


def _load_kenlm(lm_path: Path, tokens: list[str]) -> object:
    """flashlight's KenLM whose word ``i`` is ``tokens[i]``.

    The lexicon-free decoder asks the LM about token ids, so LM word ids must equal token
    ids. torchaudio's ``ctc_decoder(lm=<path>)`` builds that dictionary from a hash map
    (in no particular order) and so scores the wrong pieces; an ordered
    ``Dictionary(tokens)`` avoids it.
    """
    from flashlight.lib.text.decoder.kenlm import KenLM
    from flashlight.lib.text.dictionary import Dictionary

    return KenLM(str(lm_path), Dictionary(list(tokens)))


def _word_bonus_lm(kenlm: object, lm_weight: float, word_score: float, word_starts: set[int]) -> object:
    """A flashlight LM returning ``lm_weight * kenlm + word_score * [token starts a word]``."""
    from torchaudio.models.decoder import CTCDecoderLM

    class WordBonusLM(CTCDecoderLM):
        def __init__(self):
            CTCDecoderLM.__init__(self)

        def start(self, start_with_nothing):
            return kenlm.start(start_with_nothing)

        def score(self, state, token):
            next_state, score = kenlm.score(state, token)
            return next_state, lm_weight * score + (word_score if token in word_starts else 0.0)

        def finish(self, state):
            next_state, score = kenlm.finish(state)
            return next_state, lm_weight * score

    return WordBonusLM()


def build_decoder(
    kind: str,
    *,
    tokens: list[str],
    blank: int,
    beam_size: int,
    lm_path: str | None,
    lm_weight: float,
    word_score: float,
) -> Decoder:
    """The decoder named by params.yaml's ``evaluate`` section.

    ``kind="greedy"`` ignores the other settings; ``kind="beam"`` uses
    :class:`LMBeamSearchDecoder` when ``lm_path`` is set and :func:`prefix_beam_search`
    otherwise (``lm_weight`` and ``word_score`` only apply with an LM).

    Raises:
        AsrflowError: unknown ``kind``, a ``beam_size`` below 1, or an ``lm_path`` that
            does not exist or does not load.
    """
    if kind == "greedy":
        return lambda log_probs, lengths: greedy_decode(log_probs, lengths, blank=blank)
    if kind != "beam":
        raise AsrflowError(
            f"params.yaml: evaluate.decoder = {kind!r} is not a decoder; use one of {', '.join(DECODER_KINDS)}"
        )
    if beam_size < 1:
        raise AsrflowError(f"params.yaml: evaluate.beam_size = {beam_size}; use 1 or more")
    if lm_path:
        return LMBeamSearchDecoder(
            tokens, blank, beam_size=beam_size, lm_path=lm_path, lm_weight=lm_weight, word_score=word_score
        )
    return lambda log_probs, lengths: prefix_beam_search(log_probs, lengths, beam_size, blank=blank)
