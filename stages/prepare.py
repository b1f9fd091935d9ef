"""Stage ``prepare``: read the corpus named in params.yaml and write Lhotse manifests.

Run from the repository root::

    python -m stages.prepare --params params.yaml --out data/manifests

The work is done by :func:`asrflow.data.prepare.corpus.prepare_corpus`; see its module for the
outputs and the rules (splits, dev carving, text normalisation, rejections).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from asrflow.data.prepare.config import PrepareConfig
from asrflow.data.prepare.corpus import prepare_corpus
from asrflow.errors import exit_on_user_error
from asrflow.logs import setup_logging
from asrflow.params import load_params, read_seed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of the stage."""
    parser = argparse.ArgumentParser(
        prog="python -m stages.prepare",
        description=(
            "Read the corpus described by the `prepare:` section of the params file (a Lhotse "
            "recipe, a folder of audio with <split>.tsv files, or Kaldi data folders), reject bad "
            "items with a reason, carve a dev split from train when the corpus has none, and write "
            "Lhotse recordings/supervisions/cuts manifests (jsonl.gz) for train, dev and test, plus "
            "rejected.jsonl and summary.json. Exits 2 with a one-line message on a problem you can "
            "fix (missing corpus, bad param, too many rejected items)."
        ),
    )
    parser.add_argument(
        "--params",
        type=Path,
        default=Path("params.yaml"),
        help="params file; uses its top-level `seed` and its `prepare:` section (default: %(default)s)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("data/manifests"),
        help="output folder, replaced whole on success (default: %(default)s)",
    )
    return parser.parse_args(argv)


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, read the params and run :func:`prepare_corpus`."""
    args = parse_args(argv)
    setup_logging()
    params = load_params(args.params)
    config = PrepareConfig.from_section(params.get("prepare"))
    prepare_corpus(config, args.out, read_seed(params))


if __name__ == "__main__":
    main()
