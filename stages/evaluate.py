"""evaluate stage: decode every test set, score WER/CER, write reports and plots, log to MLflow.

Reads exp/model.pt, data/fbank's test sets (test_cuts.jsonl.gz, or those data/fbank/splits.json
lists) and params.yaml `evaluate:`; writes exp/eval/metrics.json (for `dvc metrics show`: the
pooled WER/CER at the top, each test set's under test_sets.<name>), per_utterance.jsonl, errors.txt and
wer_by_duration.csv (for `dvc plots show`), and logs them, with the training's
exp/plots/train_loss.csv and a WER-by-duration table and chart, to the training's MLflow run.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from asrflow.allocator import tune_malloc
from asrflow.errors import exit_on_user_error
from asrflow.evaluation.evaluate import EvaluateConfig, evaluate
from asrflow.evaluation.report import TEST_SETS_KEY
from asrflow.logs import setup_logging
from asrflow.params import build_config, load_params

#: Named after this module's import path (``__name__`` is ``__main__`` under ``python -m``).
logger = logging.getLogger("stages.evaluate")


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml", help="params file (default: %(default)s)")
    parser.add_argument("--model", default="exp/model.pt", help="model bundle (default: %(default)s)")
    parser.add_argument("--fbank", default="data/fbank", help="features stage output (default: %(default)s)")
    parser.add_argument("--out", default="exp/eval", help="report folder (default: %(default)s)")
    args = parser.parse_args(argv)
    setup_logging()
    tune_malloc()  # decoding batches of ever-different lengths would otherwise fragment glibc's heap
    config = build_config(EvaluateConfig, load_params(args.params).get("evaluate"), "evaluate")
    metrics = evaluate(Path(args.model), Path(args.fbank), Path(args.out), config)
    test_sets = metrics[TEST_SETS_KEY]
    if len(test_sets) > 1:
        for name, one in test_sets.items():
            print(f"{name} WER: {100 * one['wer']:.2f}%  CER: {100 * one['cer']:.2f}%")
    print(f"test WER: {100 * metrics['wer']:.2f}%  CER: {100 * metrics['cer']:.2f}%")
    logger.info(
        "test WER %.2f%%, CER %.2f%%; report in %s; browse runs with: mlflow ui --backend-store-uri "
        "sqlite:///mlflow.db",
        100 * metrics["wer"],
        100 * metrics["cer"],
        args.out,
        extra={"terminal": True},
    )


if __name__ == "__main__":
    main()
