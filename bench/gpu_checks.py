"""GPU checks on CUDA: the real-corpus preset's Trainer in bf16, SpeechBrain's same-shape model, fp16 / bf16 runs.

``python -m bench.gpu_checks [--quick] [--workdir DIR] [--seconds S] [--utterances N]``. Records ``gpu_matmul``
(bf16 peak measured), ``gpu_train`` per feature mode, precomputed and on the fly (audio-s/s over steps 2..N, MFU
against the measured peak, peak allocated memory, data-wait share), ``gpu_peer`` (bare steps of both models on the
same batches in bf16), ``gpu_precision`` (fp16 and bf16 runs of a few hundred steps: finite steps, lowest loss).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from asrflow.testing.corpora import generated_data
from asrflow.testing.repo import REPO, repo_params
from bench.common import emit, machine, parse_args, run_trainer, train_settings, workdir
from bench.train_throughput import PlannedBatches, build, model_flops


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


def on_device(batch: dict) -> dict:
    """``batch`` with its tensors on the GPU."""
    return {key: value.cuda() if hasattr(value, "cuda") else value for key, value in batch.items()}


def trainer_run(data: Path, exp: Path, settings, *, seconds: float, max_steps: int) -> list:
    """The Trainer of ``settings`` (TrainingSettings) as the train stage runs it, stopped after ``seconds`` or
    ``max_steps``; its StepResults."""
    results = []

    def stop(result) -> bool:
        results.append(result)
        return len(results) >= max_steps - 1 or sum(r.elapsed_s for r in results[1:]) > seconds

    run_trainer(data, exp, settings, after_step=stop)
    return results


def train_record(results: list, *, flops_per_audio_s: float, peak: float) -> dict:
    """Throughput, MFU, data wait and peak memory of a Trainer's steps (step 1 not timed)."""
    import torch

    timed = results[1:]
    audio, elapsed = sum(r.audio_seconds for r in timed), sum(r.elapsed_s for r in timed)
    rate = audio / elapsed
    record = {"steps": len(results), "audio_s_per_s": rate, "mfu": flops_per_audio_s * rate / peak}
    record |= {"data_wait_fraction": sum(r.data_wait_s for r in timed) / elapsed}
    record |= {"peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9}
    return record | {"all_finite": all(r.finite for r in results), "min_loss": min(r.loss for r in results)}


def bare_rate(model, optimizer, steps: list[list[dict]], precision) -> tuple[float, float]:
    """Audio-s/s and peak allocated GB of forward + CTC + backward + AdamW on ``steps`` (first one untimed)."""
    import torch

    from bench.train_throughput import bare_step

    bare_step(model, optimizer, steps[0], precision)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    seconds = 0.0
    for batches in steps[1:]:
        seconds += bare_step(model, optimizer, batches, precision)
        torch.cuda.synchronize()
    audio = sum(float(b["durations"].sum()) for batches in steps[1:] for b in batches)
    return audio / seconds, torch.cuda.max_memory_allocated() / 1e9


def peer_record(planned: PlannedBatches, settings, *, num_steps: int) -> dict:
    """asrflow's model and SpeechBrain's of the same shape (``settings``' ``train.model``), bf16 autocast, bare
    steps on ``planned``'s next batches."""
    import torch

    from asrflow.training.precision import resolve_precision
    from bench.peer.speechbrain_side import speechbrain_model

    train, features, vocab_size = settings.train, settings.features, planned.tokenizer.vocab_size
    steps = [[on_device(b) for b in planned.next_step()] for _ in range(num_steps)]
    precision = resolve_precision("bf16", "cuda", torch.cuda.get_device_capability(), ())
    model = build(train, features, 0, vocab_size)[0].cuda()
    lr = train.optim.lr
    ours = bare_rate(model, torch.optim.AdamW(model.parameters(), lr=lr, fused=True), steps, precision)
    peer = speechbrain_model(asdict(train.model), features.num_mel_bins, vocab_size).cuda()
    theirs = bare_rate(peer, torch.optim.AdamW(peer.parameters(), lr=lr, fused=True), steps, precision)
    record = {"asrflow_audio_s_per_s": ours[0], "speechbrain_audio_s_per_s": theirs[0], "ratio": ours[0] / theirs[0]}
    record |= {"asrflow_peak_gb": ours[1], "speechbrain_peak_gb": theirs[1], "memory_ratio": ours[1] / theirs[1]}
    return record | {"params": [sum(p.numel() for p in m.parameters()) for m in (model, peer)]}


def main(argv: list[str] | None = None) -> list[dict]:
    import torch

    from asrflow.presets import preset_params

    def configure(parser) -> None:
        parser.add_argument("--seconds", type=float, default=60.0, help="timed training per feature mode")
        parser.add_argument("--utterances", type=int, default=3000, help="size of the generated corpus")
        parser.add_argument("--precision-steps", type=int, default=300, help="steps of each fp16 / bf16 run")

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    peak = bf16_peak()
    matmul = {"benchmark": "gpu_matmul", "device": torch.cuda.get_device_name(0), "bf16_flops": peak}
    out = [emit({**matmul, "machine": machine()})]
    with workdir(args.workdir) as work:
        data = generated_data(work, 200 if args.quick else args.utterances)
        preset = preset_params(repo_params(), REPO / "presets" / "real-corpus.yaml")
        timing = {"train.checkpoint.checkpoint_every_steps": 10**6, "train.checkpoint.validate_every_steps": 10**6}
        fixed = {"seed": 0, "train.optim.epochs": 1000, **timing}  # steps only; stop saves

        def settings_of(precision: str, warmup_steps: int, more: dict | None = None):
            changes = {"train.optim.precision": precision, "train.optim.warmup_steps": warmup_steps, **(more or {})}
            return train_settings(preset, quick=args.quick, data=data, overrides=fixed | changes)

        settings = settings_of("bf16", 200)
        planned = PlannedBatches(data, settings, seed=0)
        model = build(settings.train, settings.features, 0, planned.tokenizer.vocab_size)[0].cuda()
        batch = on_device(planned.next_step()[0])
        flops = model_flops(model, batch) / float(batch["durations"].sum())
        del model
        for on_the_fly in (False, True):
            torch.cuda.reset_peak_memory_stats()
            mode, exp = settings_of("bf16", 200, {"features.on_the_fly": on_the_fly}), work / f"exp-{on_the_fly}-1"
            results = trainer_run(data, exp, mode, seconds=args.seconds, max_steps=10**6)
            record = {"benchmark": "gpu_train", "on_the_fly": on_the_fly, "precision": "bf16"}
            record |= {"flops_per_audio_s": flops, "max_duration_s": settings.train.data.max_duration_s}
            out.append(emit(record | train_record(results, flops_per_audio_s=flops, peak=peak)))
        out.append(emit({"benchmark": "gpu_peer", **peer_record(planned, settings, num_steps=30)}))
        for precision in ("fp16", "bf16"):
            torch.cuda.reset_peak_memory_stats()
            steps = 20 if args.quick else args.precision_steps
            runs = settings_of(precision, 100)
            results = trainer_run(data, work / f"exp-{precision}", runs, seconds=1e9, max_steps=steps)
            record = {"benchmark": "gpu_precision", "precision": precision}
            record["nonfinite_steps"] = sum(not r.finite for r in results)
            out.append(emit(record | train_record(results, flops_per_audio_s=flops, peak=peak)))
    return out


if __name__ == "__main__":
    main()
