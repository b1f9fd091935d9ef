"""tokenizer stage: SentencePiece trained on the train split's transcripts only.

Reads data/manifests/train_cuts.jsonl.gz and params.yaml `tokenizer:`; writes
data/lang/tokenizer.model and data/lang/tokens.txt. Id 0 is the CTC blank <blk>.
"""

from __future__ import annotations

import argparse
import logging

from asrflow.data.manifests import cut_text, load_cuts
from asrflow.errors import exit_on_user_error
from asrflow.files import atomic_path
from asrflow.logs import setup_logging
from asrflow.params import build_config, load_params
from asrflow.tokenizer import Tokenizer, TokenizerConfig, train_tokenizer

#: Named after this module's import path (``__name__`` is ``__main__`` under ``python -m``).
logger = logging.getLogger("stages.tokenizer")


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml", help="params file (default: %(default)s)")
    parser.add_argument("--manifests", default="data/manifests", help="prepare stage output (default: %(default)s)")
    parser.add_argument("--out", default="data/lang", help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    setup_logging()
    config = build_config(TokenizerConfig, load_params(args.params).get("tokenizer"), "tokenizer")
    texts = [cut_text(cut) for cut in load_cuts(args.manifests, "train")]
    with atomic_path(args.out) as tmp:
        model = train_tokenizer(texts, tmp, config)
        vocab = Tokenizer(model).vocab_size
    logger.info("tokenizer with %d pieces (blank included) written to %s", vocab, args.out)


if __name__ == "__main__":
    main()
