"""What every benchmark shares: JSON records on stdout (``benchmark``, ``status``, figures; logs on stderr),
the command line, the machine, timing, no-op tool runs and a stage's peak memory."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def emit(record: dict) -> dict:
    """Print ``record`` as one JSON line on stdout (``status`` defaults to ``ok``, every float :func:`rounded`,
    nested ones too); returns it as printed."""
    record = dict(record)
    record = _rounded_all({"benchmark": record.pop("benchmark"), "status": record.pop("status", "ok"), **record})
    print(json.dumps(record, default=_jsonable), flush=True)
    return record


def _rounded_all(value):
    if isinstance(value, float):
        return rounded(value)
    if isinstance(value, dict):
        return {key: _rounded_all(item) for key, item in value.items()}
    return [_rounded_all(item) for item in value] if isinstance(value, list | tuple) else value


def _jsonable(value):
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def ratio(value: float, baseline: float) -> float:
    """``value / baseline`` (NaN when the baseline is zero)."""
    return value / baseline if baseline else float("nan")


def rounded(value: float, digits: int = 4) -> float:
    """A float rounded to ``digits`` significant digits, for readable JSON."""
    if value == 0 or value != value or value in (float("inf"), float("-inf")):
        return value
    return float(f"{value:.{digits}g}")


def parse_args(
    description: str, argv: list[str] | None = None, configure: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    """``--quick`` (small sizes, for the smoke test), ``--workdir`` (shared data cache) and the options
    ``configure`` adds."""
    parser = argparse.ArgumentParser(description=description)
    if configure is not None:
        configure(parser)
    parser.add_argument("--quick", action="store_true", help="small sizes: checks that the benchmark runs")
    parser.add_argument("--workdir", type=Path, help="folder for generated data, reused (default: a temporary one)")
    args = parser.parse_args(argv)
    log_format = "%(asctime)s %(levelname)s [%(name)s] %(message)s"
    logging.basicConfig(level=logging.INFO, format=log_format, stream=sys.stderr, force=True)
    return args


@contextmanager
def workdir(path: Path | None):
    """``path`` (created), or a temporary folder removed at the end."""
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path.resolve()
        return
    tmp = Path(tempfile.mkdtemp(prefix="asrflow-bench-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_average() -> list[float]:
    """1/5/15-minute load averages (other processes compete for the cores when high)."""
    return [round(x, 2) for x in os.getloadavg()]


#: Settings from the environment that change a run's speed or memory without changing its params: each figure's
#: machine record names those that were set (the allocator preloaded, oneDNN's cache, thread counts).
PERFORMANCE_ENVIRONMENT = (
    "LD_PRELOAD",
    "MALLOC_CONF",
    "MALLOC_ARENA_MAX",
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY",
    "LRU_CACHE_CAPACITY",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
)


def machine() -> dict:
    """The machine the figures were measured on (Linux), with ``environment``: the
    :data:`PERFORMANCE_ENVIRONMENT` variables that were set, as set."""
    import torch

    from asrflow.training.tune import Machine

    here = Machine.here()
    found = {"date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M")}
    found |= {"cpu": here.cpu, "cpu_flags": list(here.flags), "cpu_count": os.cpu_count()}
    found |= {"usable_cores": here.usable_cores, "memory_gib": here.memory_gib}
    found |= {
        "gpu": here.gpu,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    found |= {"environment": {key: os.environ[key] for key in PERFORMANCE_ENVIRONMENT if key in os.environ}}
    return found | {"torch_threads": torch.get_num_threads(), "load_average": load_average()}


def matmul_flops(size: int = 2048, repeat: int = 5, threads: int | None = None) -> float:
    """Measured fp32 FLOP/s of ``torch.mm`` on two ``size`` x ``size`` matrices at ``threads`` torch threads:
    the best of ``repeat``, which stands for the peak the machine can give."""
    import torch

    from tests.support.corpora import torch_threads

    with torch_threads(threads):
        a, b = torch.randn(size, size), torch.randn(size, size)
        torch.mm(a, b)  # warm-up
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
    return 2 * size**3 / min(times)


def train_settings(params: dict, *, quick: bool, data: Path | None = None, overrides: dict | None = None):
    """``params``' :class:`~asrflow.training.assemble.TrainingSettings` for one process, with
    :data:`~tests.support.tiny_config.TINY_MODEL` when ``quick``, the features ``data`` was computed with
    (when given) and ``overrides`` (dotted keys, ``{"train.optim.epochs": 1000}``)."""
    from asrflow.params import with_overrides
    from asrflow.training.settings import TrainingSettings
    from tests.support.corpora import params_for
    from tests.support.tiny_config import TINY_MODEL

    changes = {"run.nproc_per_node": 1, "run.nnodes": 1}
    changes |= {f"train.model.{key}": value for key, value in TINY_MODEL.items()} if quick else {}
    params = params_for(data, params) if data is not None else params
    return TrainingSettings.from_params(with_overrides(params, changes | (overrides or {}), "the benchmark"))


def on_device(batch: dict, device) -> dict:
    """``batch`` with its tensors on ``device``."""
    return {key: value.to(device) if hasattr(value, "to") else value for key, value in batch.items()}


def train_until(data: Path, exp: Path, settings, *, after_step=None, uri=None):
    """The Trainer as the train stage assembles it for ``settings`` on ``data`` (``fbank/``, ``lang/``) into
    ``exp``, MLflow store ``uri`` (default: ``exp/mlflow.db``), run until it finishes or ``after_step(result)``,
    called after each step, returns true (the next step is then the last, with a checkpoint). Returns it."""
    from asrflow.training.assemble import build_trainer
    from asrflow.training.observers import TrainObserver
    from tests.support.tiny_config import train_paths

    class AfterStep(TrainObserver):
        def after_step(self, run, result):
            if after_step is not None and after_step(result):
                run.stop.request()  # the next step is the last one, then a checkpoint (as on SIGTERM)

    uri = uri or f"sqlite:///{exp / 'mlflow.db'}"
    trainer = build_trainer(settings, train_paths(data, exp), tracking_uri=uri, observers=[AfterStep()])
    trainer.run()  # returns when finished or stopped
    return trainer


def bench_train_data(data: Path, settings, *, seed: int | None = None, accum_grad: int | None = None):
    """The ``TrainData`` the Trainer builds for ``settings`` (TrainingSettings) on ``data`` (``fbank/``,
    ``lang/``), as one rank on this machine's training device; ``seed`` and ``accum_grad`` replace the
    settings' own."""
    from asrflow.training.parts import RunPlace, build_train_data
    from tests.support.tiny_config import train_paths

    return build_train_data(
        settings, train_paths(data, data / "exp"), RunPlace.single(), seed=seed, accum_grad=accum_grad
    )


def write_bundle(path: Path, data: Path, params: dict, model_state: dict | None = None, **info) -> Path:
    """A model bundle at ``path`` of ``params``' model over ``data`` (``fbank/``, ``lang/``) with ``model_state``
    (None: initial weights, seed 0) and ``info``."""
    import torch

    from asrflow.data.features.cmvn import CMVN_FILE, cmvn_stats, load_cmvn
    from asrflow.serving.bundle import save_bundle
    from asrflow.tokenizer import MODEL_FILE, Tokenizer
    from asrflow.training.parts import build_run_model
    from asrflow.training.settings import TrainingSettings
    from tests.support.corpora import data_features, params_for

    tokenizer, features = Tokenizer(data / "lang" / MODEL_FILE), data_features(data)
    torch.manual_seed(0)
    settings = TrainingSettings.from_params(params_for(data, params))
    model = build_run_model(settings, vocab_size=tokenizer.vocab_size)
    state = model_state if model_state is not None else model.state_dict()
    cmvn = cmvn_stats(load_cmvn(data / "fbank" / CMVN_FILE))
    bundle = {"model_shape": model.shape, "tokenizer": tokenizer, "features": features, "cmvn": cmvn, "run_id": None}
    save_bundle(path, model_state=state, **bundle, info=info or None)
    return path


def timed_run(command: list[str], cwd: Path, env: dict) -> tuple[float, str]:
    """Run ``command`` in ``cwd``; wall seconds and its output. Raises on a non-zero exit."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode} in {cwd}: {output[-2000:]}")
    return elapsed, output


#: A no-op run of each tool prints this (Snakemake) or runs no stage but the always-changed corpus listing (DVC).
IDLE = {
    "snakemake": lambda out: "Nothing to be done" in out,
    "dvc": lambda out: set(re.findall(r"Running stage '([^']+)'", out)) <= {"corpus_listing"},
}


def noop_runs(repo: Path, commands: dict[str, list[str]], repeats: int, *, version: bool = False) -> list[dict]:
    """Each tool's ``command`` run ``repeats`` times in ``repo`` (a built pipeline, so nothing to do), with
    its ``--version`` interleaved when ``version``: median and every ``noop_s``, ``startup_s`` and their ratio."""
    from tests.support.repo import tool_env

    env, records = tool_env(repo), []
    for name, command in commands.items():
        runs, startup = [], []
        for _ in range(repeats):  # interleaved, so both see the same load
            runs.append(timed_run(command, repo, env))
            startup += [timed_run([name, "--version"], repo, env)[0]] if version else []
        times = [elapsed for elapsed, _ in runs]
        idle = all(IDLE[name](out) for _, out in runs)
        record = {"tool": name, "status": "ok" if idle else "failed: the no-op run did work", "nothing_to_do": idle}
        record |= {"command": " ".join(command), "noop_s": statistics.median(times), "noop_s_all": times}
        record |= {"repeats": repeats, "load_average": load_average()}
        if version:
            record |= {"startup_s": statistics.median(startup)}
            record["ratio"] = ratio(record["noop_s"], record["startup_s"])
        records.append(record)
    return records
