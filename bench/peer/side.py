"""What both sides' training processes share: FLOPs per model part, the report they write."""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: Module names (the last part of a module path) of each model part, asrflow's and SpeechBrain's.
PARTS = {
    "front_end": ("subsampling", "cnn", "custom_src_module"),
    "attention": ("self_attn", "mha_layer"),
    "convolution": ("conv_module", "convolution_module"),
    "feed_forward": ("ffn1", "ffn2", "ffn_module1", "ffn_module2"),
    "ctc_head": ("head", "ctc_lin"),
}


def flops_by_part(counts: dict[str, dict]) -> dict[str, float]:
    """FLOPs per model part from ``FlopCounterMode.get_flop_counts()`` (module path -> op -> FLOPs)."""
    parts = dict.fromkeys(PARTS, 0.0)
    for path, ops in counts.items():
        leaf = path.rsplit(".", 1)[-1]
        for part, names in PARTS.items():
            if leaf in names:
                parts[part] += sum(ops.values())
    parts["other"] = sum(counts.get("Global", {}).values()) - sum(parts.values())
    return parts


def audio_rate(steps: list[dict]) -> float | None:
    """Audio seconds trained per wall second after the first step, from each step's end ``t`` (unix s) and
    ``audio_s``; None with fewer than two steps."""
    if len(steps) < 2:
        return None
    return sum(step["audio_s"] for step in steps[1:]) / (steps[-1]["t"] - steps[0]["t"])


def peak_gpu_mb() -> float | None:
    """The most GPU memory this process's tensors held (MB), or None without CUDA."""
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def report(model, forward_backward, first_batch: dict, *, steps: list, launched: float, dev_loss, settings) -> dict:
    """One side's report: per-step end times, FLOPs of ``forward_backward`` per audio second, parameters, the
    peak GPU memory of its training."""
    gpu_mb = peak_gpu_mb()  # before the FLOP count's extra forward and backward
    from torch.utils.flop_counter import FlopCounterMode

    audio_s = float(first_batch["durations"].sum())
    with FlopCounterMode(display=False) as counter:
        forward_backward()
    found = {"steps": steps, "launched": launched, "dev_loss": dev_loss, "settings": settings, "peak_gpu_mb": gpu_mb}
    found["flops_by_part"] = {k: v / audio_s for k, v in flops_by_part(counter.get_flop_counts()).items()}
    found["params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return found | {"flops_per_audio_s": counter.get_total_flops() / audio_s}


#: How often the parent reads its child's process tree for the peak PSS (seconds).
PSS_POLL_S = 1.0


def run_child(module: str, options: dict, log: Path, env: dict[str, str]) -> dict:
    """``python -m module REPORT LAUNCHED OPTIONS`` (a :func:`run_as_child` script) from the repository in a process
    of its own, output to ``log``: its report, with ``peak_tree_pss_mb`` of its process tree.

    Raises:
        RuntimeError: it failed or wrote no report; the message names ``log`` and holds its tail.
    """
    import time

    from tests.support.processes import ChildProcess
    from tests.support.repo import REPO

    report_path = log.with_suffix(".json")
    report_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", module, str(report_path), repr(time.time()), json.dumps(options)]
    process = ChildProcess(command, log_path=log, env=env, cwd=REPO, memory_poll_s=PSS_POLL_S)
    code = process.wait()
    if code != 0 or not report_path.is_file():
        raise RuntimeError(f"{module} exited {code}; log {log}:\n{process.tail()}")
    return {**json.loads(report_path.read_text()), "peak_tree_pss_mb": process.peak_pss / 2**20}


def run_as_child(train) -> None:
    """Arguments ``REPORT LAUNCHED OPTIONS``: ``train(OPTIONS as JSON, LAUNCHED unix time)`` as JSON into REPORT."""
    report, launched, options = sys.argv[1:4]
    Path(report).write_text(json.dumps(train(json.loads(options), float(launched))))
