"""Does the default recipe train yesno at every seed? The train and evaluate stages, once per seed.

For each seed, params.yaml with that ``seed`` (and any ``--set section.key=value``) trains
on the shipped yesno corpus (``python -m stages.train``, then ``python -m stages.evaluate``,
each a process of its own as the pipeline runs them). The seed draws the model's initial
weights, the batch order, the augmentation and, as in the pipeline, which train utterances
the prepare stage moves to dev; prepare, features and tokenizer run once per seed and per
``prepare.*`` / ``features.*`` / ``tokenizer.*`` override, cached in ``--workdir``.

Record ``yesno_seed`` per seed: ``test_wer``, ``train_s`` (the train stage's wall time),
``left_plateau_at_step`` (the first logged step whose train loss per token is below 0.5:
CTC's blank plateau sits at 0.8-1.0 here; None = never) and ``last_train_loss``.

Usage: ``python -m bench.yesno_seeds [--seeds 1 2 3 42] [--set train.optim.lr=0.001 ...] [--workdir DIR]``
(a few minutes per seed on 2 cores; ``--quick``: one seed, 2 epochs).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

from asrflow.testing.corpora import yesno_data
from asrflow.testing.repo import REPO
from bench.common import emit, machine, parse_args, rounded, workdir

#: A step line of asrflow.training.monitoring: "step 40 epoch 3: loss 0.9709 ...".
STEP_LINE = re.compile(r"step (\d+) epoch \d+: loss ([0-9.]+|nan|inf)")
PLATEAU_LOSS = 0.5


def seeded_params(seed: int, overrides: list[str], quick: bool) -> dict:
    """params.yaml with ``seed`` and the ``section.key=value`` overrides (values parsed as YAML)."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["seed"] = seed
    for override in overrides + (["train.optim.epochs=2"] if quick else []):
        key, _, value = override.partition("=")
        *sections, name = key.split(".")
        node = params
        for section in sections:
            node = node.get(section) if isinstance(node, dict) else None
        if not sections or not isinstance(node, dict) or name not in node:
            raise SystemExit(f"--set {override}: no such key in params.yaml (use section.key=value)")
        node[name] = yaml.safe_load(value)
    return params


def run_seed(data: Path, out: Path, params: dict) -> dict:
    """Train and evaluate with ``params`` in ``out``; the figures of one seed."""
    out.mkdir(parents=True, exist_ok=True)
    params_file = out / "params.yaml"
    params_file.write_text(yaml.safe_dump(params))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{out / 'mlflow.db'}", "GIT_PYTHON_REFRESH": "quiet"}
    common = ["--params", str(params_file), "--fbank", str(data / "fbank")]
    started = time.perf_counter()
    train = subprocess.run(
        [sys.executable, "-m", "stages.train", *common, "--lang", str(data / "lang"), "--exp", str(out / "exp")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    train_s = time.perf_counter() - started
    (out / "train.log").write_text(train.stdout + train.stderr)
    if train.returncode != 0:
        raise RuntimeError(f"train stage exited {train.returncode}; log {out / 'train.log'}")
    losses = [(int(step), float(loss)) for step, loss in STEP_LINE.findall(train.stderr + train.stdout)]
    evaluate = subprocess.run(
        [sys.executable, "-m", "stages.evaluate", *common, "--model", str(out / "exp" / "model.pt")]
        + ["--out", str(out / "eval")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    (out / "evaluate.log").write_text(evaluate.stdout + evaluate.stderr)
    if evaluate.returncode != 0:
        raise RuntimeError(f"evaluate stage exited {evaluate.returncode}; log {out / 'evaluate.log'}")
    metrics = json.loads((out / "eval" / "metrics.json").read_text())
    left = next((step for step, loss in losses if loss < PLATEAU_LOSS), None)
    return {
        "test_wer": rounded(metrics["wer"]),
        "word_errors": metrics["word_errors"],
        "train_s": rounded(train_s),
        "left_plateau_at_step": left,
        "last_train_loss": losses[-1][1] if losses else None,
        "steps_logged": len(losses),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser) -> None:
        parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 42], help="seeds to train with")
        parser.add_argument(
            "--set", dest="overrides", action="append", default=[], help="section.key=value on top of params.yaml"
        )

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    seeds = args.seeds[:1] if args.quick else args.seeds
    out = [emit({"benchmark": "machine", **machine()})]
    with workdir(args.workdir) as work:
        for seed in seeds:
            params = seeded_params(seed, args.overrides, args.quick)
            data = yesno_data(work, params)
            record = {"benchmark": "yesno_seed", "seed": seed, "overrides": args.overrides}
            try:
                record.update(status="ok", **run_seed(data, work / f"seed-{seed}", params))
            except RuntimeError as error:
                record.update(status="failed", reason=str(error))
            out.append(emit(record))
    return out


if __name__ == "__main__":
    main()
