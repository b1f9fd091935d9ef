"""train stage: Conformer-CTC training with step checkpoints, exact resume and MLflow logging.

Reads data/fbank/, data/lang/ and params.yaml (`seed`, `features:`, `train:`); writes
exp/model.pt (a self-contained bundle) and exp/plots/train_loss.csv; keeps checkpoints in
exp/checkpoints/ across runs, so running again after an interruption resumes. With
train.nproc_per_node > 1 or train.nnodes > 1 it re-launches itself under torchrun; on the
machines other than the first of a multi-node run, start it with --node-rank.
Exit code 75: stopped by SIGTERM/SIGINT after saving a checkpoint; run again to resume.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from asrflow.data.features import FeatureConfig
from asrflow.errors import exit_on_user_error
from asrflow.logs import setup_logging
from asrflow.params import build_config, load_params, read_seed
from asrflow.tracking import check_tracking_uri
from asrflow.training.config import TrainConfig
from asrflow.training.launch import needs_torchrun, torchrun_command
from asrflow.training.trainer import Trainer, TrainPaths


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml", help="params file (default: %(default)s)")
    parser.add_argument("--exp", default="exp", help="experiment folder (default: %(default)s)")
    parser.add_argument(
        "--node-rank", type=int, default=None,
        help="this machine's rank in a multi-node run (overrides train.node_rank; 0 .. train.nnodes-1)",
    )
    args = parser.parse_args(argv)
    logger = setup_logging()
    params = load_params(args.params)
    config = build_config(TrainConfig, params.get("train"), "train")
    if args.node_rank is not None:
        config = replace(config, node_rank=args.node_rank)
    features = build_config(FeatureConfig, params.get("features"), "features")
    check_tracking_uri()  # an unreachable MLFLOW_TRACKING_URI stops here, before any training
    if needs_torchrun(config):
        command = torchrun_command(config, ["-m", "stages.train", *(argv if argv is not None else sys.argv[1:])])
        logger.info("launching %s", " ".join(command))
        os.execvp(command[0], command)
    paths = TrainPaths(
        model_path=Path(args.exp) / "model.pt",
        checkpoint_dir=Path(args.exp) / "checkpoints",
        loss_csv=Path(args.exp) / "plots" / "train_loss.csv",
        bad_batches=Path(args.exp) / "bad_batches.jsonl",
    )
    summary = Trainer(config, features, read_seed(params), params, paths).run()
    logger.info("training done: %s", summary)


if __name__ == "__main__":
    main()
