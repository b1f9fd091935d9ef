"""Smoke test of bench/: ``python -m bench.run_all --quick`` runs every benchmark and prints its figures.

Nothing here looks at how fast anything is (speed goals live in bench/ and
bench/RESULTS.md): only that each benchmark ran and printed numbers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from bench.common import PERFORMANCE_ENVIRONMENT, machine
from tests.support.repo import REPO

FIGURES = {
    "machine": ["cpu_count", "usable_cores"],
    "matmul_fp32": ["flops"],
    "train_throughput": [
        "loop_audio_s_per_s",
        "bare_audio_s_per_s",
        "ratio",
        "flops_per_audio_s",
        "matmul_flops",
        "mfu_loop",
        "mfu_bare",
    ],
    "data_wait": ["data_wait_fraction"],
    "cpu_precision": ["audio_s_per_s", "ratio_to_fp32"],
    "padding": ["padding_ratio", "baseline_random_padding_ratio", "ratio"],
    "features_speed": ["audio_s_per_s", "speedup"],
    "scale": [
        "plan_s_per_million",
        "baseline_plan_s_per_million",
        "worker_rss_growth_mb_per_million",
        "resume_s",
        "resume_90_vs_10",
    ],
    "pipeline_overhead": ["noop_s", "startup_s", "ratio"],
    "decode_rtf": ["rtf_greedy", "rtf_beam", "rtf_encoder"],
    "startup": ["launch_to_first_step_s", "breakdown_median_s"],
}


def _numbers(value) -> list[float]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    if isinstance(value, bool):
        return []
    return [float(value)] if isinstance(value, int | float) else []


def test_the_machine_record_names_the_environment_that_changes_speed_or_memory(monkeypatch):
    for key in PERFORMANCE_ENVIRONMENT:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # not one of them
    assert machine()["environment"] == {
        "LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024",
    }


@pytest.mark.pipeline
@pytest.mark.bench
def test_run_all_quick_prints_every_benchmark(tmp_path):
    output = tmp_path / "results.json"
    env = {**os.environ, "GIT_PYTHON_REFRESH": "quiet"}
    env.pop("MLFLOW_TRACKING_URI", None)
    done = subprocess.run(
        [sys.executable, "-m", "bench.run_all", "--quick", "--output", str(output), "--workdir", str(tmp_path / "w")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert printed == json.loads(output.read_text())["records"]
    by_name: dict[str, list[dict]] = {}
    for record in printed:
        by_name.setdefault(record["benchmark"], []).append(record)

    for name, figures in FIGURES.items():
        assert name in by_name, f"{name} printed nothing; stderr: {done.stderr[-2000:]}"
        for record in by_name[name]:
            assert record["status"] == "ok", record
            for figure in figures:
                values = _numbers(record.get(figure))
                assert values and all(math.isfinite(v) for v in values), (name, figure, record)
    # Measured elsewhere or not here: present with a status saying what happened.
    assert by_name["gpu_bf16"][0]["status"].startswith(("ok", "not measured"))
    assert by_name["summary"][0]["goals"]
    # The peer benchmark: measured, or the peer could not be installed (then no ratio).
    for record in by_name["peer_speed"]:
        assert record["status"] in ("ok", "peer unavailable"), record
        assert _numbers(record["asrflow"]["audio_s_per_s"]) and _numbers(record["asrflow"]["start_to_first_step_s"])
        assert ("ratio" in record) is (record["status"] == "ok"), record
