"""CTC decoding: greedy, prefix beam search, and KenLM-fused beam search."""

from asrflow.decoding.ctc import (
    DECODER_KINDS,
    Decoder,
    LMBeamSearchDecoder,
    build_decoder,
    greedy_decode,
    prefix_beam_search,
)

__all__ = [
    "DECODER_KINDS",
    "Decoder",
    "LMBeamSearchDecoder",
    "build_decoder",
    "greedy_decode",
    "prefix_beam_search",
]
