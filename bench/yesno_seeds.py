"""Does the default recipe train yesno at every seed? The train and evaluate stages, once per seed.

``python -m bench.yesno_seeds [--seeds 1 2 3 42] [--set section.key=value ...] [--workdir DIR]``. Record
``yesno_seed``: ``test_wer``, ``train_s``, ``left_plateau_at_step`` (first logged train loss per token below
:data:`PLATEAU_LOSS`), ``last_train_loss``.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import yaml

from asrflow.errors import AsrflowError
from asrflow.params import with_overrides
from bench.common import emit, machine, parse_args, rounded, workdir
from tests.support.corpora import yesno_data
from tests.support.processes import ChildProcess
from tests.support.repo import REPO

#: A step line of asrflow.training.monitoring: "step 40 epoch 3: loss 0.9709 ...".
STEP_LINE = re.compile(r"step (\d+) epoch \d+: loss ([0-9.]+|nan|inf)")
PLATEAU_LOSS = 0.5


def seeded_params(seed: int, overrides: list[str], quick: bool) -> dict:
    """params.yaml with ``seed`` and the ``section.key=value`` overrides (values parsed as YAML); an unknown key is
    refused as params.yaml's own keys are (:func:`asrflow.params.with_overrides`: its path and the nearest key)."""
    settings = overrides + (["train.optim.epochs=2"] if quick else [])
    if malformed := [setting for setting in settings if "." not in setting.partition("=")[0] or "=" not in setting]:
        raise SystemExit(f"--set {malformed[0]}: use section.key=value (the seed comes from --seeds)")
    dotted = {key: yaml.safe_load(value) for key, _, value in (setting.partition("=") for setting in settings)}
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    try:
        return with_overrides(params, {"seed": seed} | dotted, "--set")
    except AsrflowError as error:
        raise SystemExit(str(error)) from None


def stage(module: str, args: list[str], out: Path, env: dict) -> str:
    """``python -m stages.<module> args`` from the repository root: its log (``RuntimeError`` when it fails)."""
    log = out / f"{module}.log"
    process = ChildProcess([sys.executable, "-m", f"stages.{module}", *args], log_path=log, env=env, cwd=REPO)
    if (code := process.wait()) != 0:
        raise RuntimeError(f"{module} stage exited {code}; log {log}")
    return process.log()


def run_seed(data: Path, out: Path, params: dict) -> dict:
    """Train and evaluate with ``params`` in ``out``; the figures of one seed."""
    out.mkdir(parents=True, exist_ok=True)
    params_file = out / "params.yaml"
    params_file.write_text(yaml.safe_dump(params))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{out / 'mlflow.db'}", "GIT_PYTHON_REFRESH": "quiet"}
    common = ["--params", str(params_file), "--fbank", str(data / "fbank")]
    started = time.perf_counter()
    log = stage("train", [*common, "--lang", str(data / "lang"), "--exp", str(out / "exp")], out, env)
    train_s = time.perf_counter() - started
    losses = [(int(step), float(loss)) for step, loss in STEP_LINE.findall(log)]
    stage("evaluate", [*common, "--model", str(out / "exp" / "model.pt"), "--out", str(out / "eval")], out, env)
    metrics = json.loads((out / "eval" / "metrics.json").read_text())
    left = next((step for step, loss in losses if loss < PLATEAU_LOSS), None)
    figures = {"test_wer": rounded(metrics["wer"]), "word_errors": metrics["word_errors"], "train_s": rounded(train_s)}
    last = losses[-1][1] if losses else None
    return {**figures, "left_plateau_at_step": left, "last_train_loss": last, "steps_logged": len(losses)}


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser) -> None:
        parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 42], help="seeds to train with")
        parser.add_argument("--set", dest="overrides", action="append", default=[], help="section.key=value")

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
