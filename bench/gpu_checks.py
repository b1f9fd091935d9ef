"""GPU checks (shared/GPU_CHECKS.md) on CUDA, the real-corpus preset in bf16, each in a fresh process.

``python -m bench.gpu_checks [--quick] [--workdir DIR] [--utterances N] [--steps N] [--budget S] [--out DIR]``.
Records (``checks.jsonl`` in ``--out``, and stdout): ``gpu_matmul`` (the measured bf16 peak), ``gpu_bare`` per
batch-shape variant (as the Trainer runs, frames padded to 64, the preset's model without position terms in its
attention, and with expandable CUDA allocator segments: the first pass over new shapes against the second),
``gpu_sizes`` (audio-s/s, MFU and peak memory by batch size), ``gpu_trainer`` (the Trainer's first 200 steps against
a warm pass, precomputed features; then on the fly with ``auto`` workers), ``peer_speed`` with ``loop: whole``
(asrflow's Trainer against SpeechBrain's own Brain and data pipeline, :func:`peer_whole_loop`), ``gpu_decode`` (the
evaluate stage's decoding on the CPU and the GPU: real-time factors, the same transcripts), ``host_cpu_tune`` (the
machine tuner on the host CPU, ``host-cpu-preset.yaml``), ``gpu_profile`` (host time by operator over the first 5
steps, ``profile.txt``), in that order. Checks that would not finish inside ``--budget`` are recorded as skipped. On
a lent machine, which reaches no registry, the packages its image lacks (SpeechBrain among them) travel as wheels:
``python -m bench.gpu_wheels`` fetches them into ``.whl``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import emit, machine, parse_args, workdir
from tests.support.corpora import generated_data
from tests.support.repo import REPO


def bf16_peak(size: int = 8192, repeat: int = 10) -> float:
    """Measured bf16 FLOP/s of ``torch.mm`` on two ``size`` x ``size`` matrices (the mean of ``repeat``)."""
    import torch

    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        torch.mm(a, b)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        torch.mm(a, b)
    torch.cuda.synchronize()
    return 2 * size**3 * repeat / (time.perf_counter() - start)


def probe(kind: str, data: Path, *options: str, timeout: float, log: Path | None) -> list[dict]:
    """``python -m bench.gpu_probe KIND`` in a fresh process; its records, or one saying why there are none."""
    command = [sys.executable, "-m", "bench.gpu_probe", kind, "--data", str(data), *options]
    return records_of(command, f"gpu_{kind}", options, timeout=timeout, log=log)


def peer_whole_loop(work: Path, *, quick: bool, timeout: float, log: Path | None) -> list[dict]:
    """``python -m bench.peer_speed --loop whole`` (shared/GPU_CHECKS.md item 5): asrflow's Trainer and SpeechBrain's
    own loop at the preset's shape in bf16, once each, 4 data workers each, 4 epochs (128 steps a side: at 64,
    SpeechBrain's own rate moved by 45 % between two runs of the seventh GPU run); its records."""
    options = ["--loop", "whole", "--corpora", "generated", "--precision", "bf16", "--repeats", "1"]
    options += [
        "--settings",
        "1x4",
        "1x4",
        "--params",
        str(REPO / "presets" / "real-corpus.yaml"),
        "--workdir",
        str(work),
    ]
    options += ["--quick", "--steps", "4"] if quick else ["--epochs", "4"]
    command = [sys.executable, "-m", "bench.peer_speed", *options]
    return records_of(command, "gpu_peer_whole_loop", options, timeout=timeout, log=log)


def records_of(command: list[str], name: str, options, *, timeout: float, log: Path | None) -> list[dict]:
    """``command``'s JSON records (its stdout lines starting with ``{``), and one named ``name`` saying why when it
    failed or timed out; its stderr appended to ``log``."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=max(timeout, 1), cwd=REPO)
    except subprocess.TimeoutExpired as expired:
        out, err, problem = expired.stdout or "", expired.stderr or "", f"timed out after {timeout:.0f} s"
    else:
        out, err, problem = done.stdout, done.stderr, None if done.returncode == 0 else f"exit {done.returncode}"
    out, err = (text.decode() if isinstance(text, bytes) else text for text in (out, err))
    if log is not None:
        with log.open("a") as file:
            file.write(f"$ {' '.join(command)}\n{err}\n")
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if problem:
        tail = err.strip().splitlines()[-3:]
        records.append({"benchmark": name, "status": "failed", "options": options, "why": problem, "tail": tail})
    return [emit(record) for record in records]


#: Seconds the host-CPU tuner may take; the GPU checks after it keep the rest of the budget.
HOST_TUNE_S = 150.0


def main(argv: list[str] | None = None) -> list[dict]:
    import torch

    def configure(parser) -> None:
        parser.add_argument("--utterances", type=int, default=2000, help="size of the generated corpus")
        parser.add_argument("--steps", type=int, default=80, help="bare steps per pass of each shape variant")
        parser.add_argument("--budget", type=float, default=540.0, help="seconds for all checks; later ones skip")
        parser.add_argument("--out", type=Path, help="folder for the records (checks.jsonl) and the logs")

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    started = time.monotonic()
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="gpu-checks-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    records_path, log = out_dir / "checks.jsonl", out_dir / "probes.log"

    def keep(records: list[dict]) -> list[dict]:
        with records_path.open("a") as file:
            file.writelines(json.dumps(record) + "\n" for record in records)
        return records

    def left() -> float:
        return args.budget - (time.monotonic() - started)

    peak = bf16_peak() if torch.cuda.is_available() else 1.0
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    out = keep([emit({"benchmark": "gpu_matmul", "device": name, "bf16_flops": peak, "machine": machine()})])
    quick = ["--quick"] if args.quick else []
    steps = str(4 if args.quick else args.steps)
    with workdir(args.workdir) as work:
        utterances = 200 if args.quick else args.utterances
        # 40 dev utterances, as bench.peer_speed generates its corpus: the peer check below finds it ready
        data = generated_data(work, utterances, dev_utterances=4 if args.quick else 40)
        ready = {"benchmark": "gpu_data", "utterances": utterances, "ready_after_s": args.budget - left()}
        out += keep([emit(ready)])

        def run(kind: str, *options: str, cap: float) -> list[dict]:
            if left() < 20:
                return keep([emit({"benchmark": f"gpu_{kind}", "status": "skipped", "options": options})])
            common = [*quick, "--workdir", str(work)]
            return keep(probe(kind, data, *options, *common, timeout=min(cap, left() - 10), log=log))

        # As the Trainer runs the preset (rel_pos attention), frames padded to 64 too, without positions (what
        # rel_pos costs on a GPU), and with expandable allocator segments (whether a new shape's cost is the
        # allocator's).
        variants = {
            "default": [],
            "pad64": ["--pad-frames-to", "64"],
            "no-positions": ["--attention", "none"],
            "expandable": ["--cuda-alloc-conf", "expandable_segments:True"],
        }
        bare = {name: run("bare", "--steps", steps, *options, cap=90) for name, options in variants.items()}
        sizes = ["--sizes", *(["60", "120"] if args.quick else ["600", "1200", "2400", "4800", "9600"])]
        out += [*(r for records in bare.values() for r in records)]
        out += run("sizes", *sizes, "--peak", str(peak), cap=100)
        trainable = ("default", "pad64")  # the preset's model
        rates = {name: bare[name][0].get("first_pass_audio_s_per_s", 0.0) for name in trainable if bare[name]}
        best = max(rates, key=rates.get) if rates else "default"
        trainer_steps = "6" if args.quick else "200"
        out += run("trainer", "--steps", trainer_steps, "--seconds", "45", *variants[best], cap=150)
        if left() < 60:
            out += keep([emit({"benchmark": "gpu_peer_whole_loop", "status": "skipped"})])
        else:
            out += keep(peer_whole_loop(work, quick=args.quick, timeout=min(200, left() - 20), log=log))
        # 2 workers on the fly were measured before (bench/RESULTS.md#gpu-data-workers); `auto` is the default.
        options = ["--on-the-fly", "--num-workers", "auto", "--once", "--steps", trainer_steps, "--seconds", "25"]
        out += run("trainer", *options, *variants[best], cap=100)
        # Measured in earlier runs (bench/RESULTS.md#decode-gpu): last, so a short budget skips them first.
        decoded = ["--steps", "8" if args.quick else "300", "--batch-seconds", "60" if args.quick else "600"]
        out += run("decode", *decoded, cap=90)
        out += keep(host_cpu_tune(out_dir / "host-cpu-preset.yaml", timeout=min(HOST_TUNE_S, left() - 60)))
        # 20 profiled steps timed out at 45 s in four runs in a row, in the summary after the steps
        out += run("profile", "--steps", "2" if args.quick else "5", "--out", str(out_dir / "profile.txt"), cap=60)
        if best != "default":
            out += run("trainer", "--steps", trainer_steps, "--seconds", "45", "--once", cap=70)
    return out


def host_cpu_tune(preset: Path, *, timeout: float) -> list[dict]:
    """``python -m asrflow.training.tune`` on the GPU machine's host CPU (the GPU hidden): another CPU model
    measured, its figures in the preset's header."""
    if timeout < 60:
        return [emit({"benchmark": "host_cpu_tune", "status": "skipped"})]
    command = [sys.executable, "-m", "asrflow.training.tune", "--seconds", "3", "--out", str(preset)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    try:
        done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:  # what it measured so far is in its log lines
        said = expired.stderr.decode() if isinstance(expired.stderr, bytes) else expired.stderr or ""
        why = f"timed out after {timeout:.0f} s"
        return [emit({"benchmark": "host_cpu_tune", "status": "failed", "why": why, "tail": said.splitlines()[-4:]})]
    status = "ok" if done.returncode == 0 else "failed"
    return [emit({"benchmark": "host_cpu_tune", "status": status, "tail": done.stderr.strip().splitlines()[-4:]})]


if __name__ == "__main__":
    main()
