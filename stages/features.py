"""features stage: 80-dim fbank for every split with Lhotse, plus global CMVN statistics.

Reads data/manifests/{train,dev,<each test set>}_cuts.jsonl.gz and params.yaml `features:`;
writes data/fbank/ (features, cuts with features, cmvn.json) as one folder.
"""

from __future__ import annotations

import argparse
import logging

from asrflow.data.features.config import FeatureConfig
from asrflow.data.features.extract import compute_features
from asrflow.errors import exit_on_user_error
from asrflow.logs import setup_logging
from asrflow.params import build_config, load_params

#: Named after this module's import path (``__name__`` is ``__main__`` under ``python -m``).
logger = logging.getLogger("stages.features")


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml", help="params file (default: %(default)s)")
    parser.add_argument("--manifests", default="data/manifests", help="prepare stage output (default: %(default)s)")
    parser.add_argument("--out", default="data/fbank", help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    setup_logging()
    config = build_config(FeatureConfig, load_params(args.params).get("features"), "features")
    counts = compute_features(args.manifests, args.out, config)
    logger.info("features written to %s: %s", args.out, ", ".join(f"{k} {v} cuts" for k, v in counts.items()))


if __name__ == "__main__":
    main()
