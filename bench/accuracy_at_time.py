"""Accuracy at equal wall time: the train stage for the same minutes per variant, then its test WER and CER.

``python -m bench.accuracy_at_time --data RUN --minutes 20 --variant NAME=JSON [--variant NAME=JSON ...]``

``RUN`` is a folder holding ``params.yaml``, ``fbank/`` and ``lang/``, as ``python -m bench.stage_scale`` leaves
``W/run-spoken-<hours>``; ``--quick`` uses the shipped yesno corpus instead. Each variant is ``RUN``'s params with
its overrides (dotted keys, JSON) on top, trained in a run folder of its own (``W/accuracy-<NAME>``) by the train
stage as users run it, stopped by SIGTERM after ``--minutes`` from launch; the variants run one after another, so
each has the machine to itself. The evaluate stage then decodes ``RUN``'s test split with the newest checkpoint (what
the run had reached; not averaged).

Records ``accuracy_at_time`` per variant: its overrides, the steps it reached, the last logged train loss per
token, test ``wer`` and ``cer``, the model's parameters and the training tree's peak PSS.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from asrflow.params import with_overrides
from bench.common import emit, load_average, machine, parse_args, workdir
from bench.memory_hour import run_one
from bench.stage_scale import bundle_from_checkpoint
from tests.support.corpora import params_for, yesno_data
from tests.support.repo import repo_params
from tests.support.stage_memory import stage_peaks

#: What ``--quick`` compares on yesno: the shipped model and one other, for a few seconds each.
QUICK_VARIANTS = {"shipped": {}, "rel_pos": {"train.model.attention": "rel_pos"}}


def variant(text: str) -> tuple[str, dict]:
    """``NAME=JSON`` (dotted keys) -> ``(NAME, overrides)``; argparse's type for ``--variant``."""
    name, separator, overrides = text.partition("=")
    example = "e.g. 'lr1e-3={\"train.optim.lr\": 0.001}'"
    if not separator or not name or "/" in name:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=JSON, {example}")
    try:
        found = json.loads(overrides or "{}")
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: the overrides are not JSON ({error}), {example}") from None
    if not isinstance(found, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: the overrides are not a JSON object, {example}")
    return name, found


def train_for(run_dir: Path, data: Path, params: dict, minutes: float) -> dict:
    """The train stage in a fresh ``run_dir`` on ``data`` for ``minutes``: steps, last train loss, peak PSS."""
    found = run_one(run_dir, data, params, minutes)
    last = max(found["losses"], default=None)
    return {
        "steps": last or 0,
        "last_train_loss": found["losses"][last] if last is not None else None,
        "train_exit_code": found["exit_code"],
        "train_peak_tree_pss_mb": found["peak_tree_pss_mb"],
    }


def score_run(run_dir: Path, data: Path) -> dict:
    """The evaluate stage on ``data``'s test split with ``run_dir``'s newest checkpoint: WER, CER, parameters."""
    import torch

    bundle = bundle_from_checkpoint(run_dir, data, made_by="bench.accuracy_at_time")
    parameters = sum(tensor.numel() for tensor in torch.load(bundle, weights_only=False)["model"].values())
    argv = ["--params", str(run_dir / "params.yaml"), "--model", str(bundle), "--fbank", str(data / "fbank")]
    found = stage_peaks("stages.evaluate", [*argv, "--out", str(run_dir / "exp" / "eval")], run_dir / "evaluate.log")
    metrics = json.loads((run_dir / "exp" / "eval" / "metrics.json").read_text())
    return {"wer": metrics["wer"], "cer": metrics["cer"], "parameters": parameters, "evaluate_s": found["elapsed_s"]}


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser) -> None:
        parser.add_argument("--data", type=Path, help="run folder with params.yaml, fbank/, lang/ (not with --quick)")
        parser.add_argument("--minutes", type=float, default=20.0, help="training time per variant (default: 20)")
        parser.add_argument(
            "--variant",
            type=variant,
            action="append",
            default=[],
            help="NAME=JSON: params overrides, dotted keys; repeat for each variant (run in this order)",
        )

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    if not args.quick and (args.data is None or not args.variant):
        raise SystemExit("bench.accuracy_at_time: --data RUN and at least one --variant are needed, or --quick")
    minutes = 0.3 if args.quick else args.minutes
    variants = dict(args.variant) or (QUICK_VARIANTS if args.quick else {})
    records = [emit({"benchmark": "machine", **machine(), "load_before": load_average()})]
    with workdir(args.workdir) as work:
        data = yesno_data(work) if args.quick else args.data.resolve()
        base = params_for(data, repo_params()) if args.quick else yaml.safe_load((data / "params.yaml").read_text())
        for name, overrides in variants.items():
            params = with_overrides(base, {"train.optim.epochs": 1000, **overrides}, f"--variant {name}")
            run_dir = work / f"accuracy-{name}"
            record = {"benchmark": "accuracy_at_time", "variant": name, "overrides": overrides, "minutes": minutes}
            record |= {"data": str(data), "load_before": load_average()}
            record |= train_for(run_dir, data, params, minutes) | score_run(run_dir, data)
            records.append(emit(record | {"load_after": load_average()}))
    return records


if __name__ == "__main__":
    main()
