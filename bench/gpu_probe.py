"""One GPU measurement in a fresh process, for ``bench.gpu_checks``: what the first pass over new batch shapes
costs, the batch sizes that train, data wait.

``python -m bench.gpu_probe KIND --data DIR [options]``, one JSON record per line on stdout. Kinds:

- ``bare``: bare steps (forward, CTC, backward, AdamW; bf16 autocast) over the next ``--steps`` planned batches,
  twice: the first pass (every batch shape met for the first time in this process is timed as it comes) and a
  second over the same batches. Per pass audio-s/s, and in the first the mean seconds of a step whose
  (utterances, frames) shape is new against one already seen.
- ``trainer``: the Trainer as the train stage assembles it, ``--steps`` steps, twice in this process on the same
  batches (a fresh run each time): the first pass and a warm one, audio-s/s and data wait.
- ``sizes``: bare steps at each ``--sizes`` batch size (seconds of audio): audio-s/s, MFU against ``--peak``,
  peak memory, or the error that stopped it.
- ``profile``: ``torch.profiler`` over the first ``--steps`` bare steps; the operators with the most host time.
- ``decode``: the evaluate stage's greedy decoding of ``--steps`` utterances on the CPU and on the GPU (the
  preset's model, drawn weights): real-time factors, transcripts that agree.

``--pad-frames-to`` sets ``train.data.pad_frames_to``; ``--no-cudnn`` turns cuDNN off for the whole process;
``--cudnn-attention`` lets attention use cuDNN's kernel (the Trainer's process does not; ``rel_pos`` attention uses
no fused kernel); ``--attention`` sets ``train.model.attention`` (default: the preset's);
``--old-norm`` restores the (C, F) LayerNorm call of ConvFrameNorm that PyTorch's CUDA backward breaks on;
``--cuda-alloc-conf`` sets ``PYTORCH_CUDA_ALLOC_CONF`` before the first CUDA allocation (e.g.
``expandable_segments:True``: whether growing the caching allocator's segments is what a new batch shape costs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from asrflow.model.positions import ATTENTION_KINDS
from bench.common import on_device
from tests.support.repo import REPO, repo_params

#: The model and batches measured: the real-corpus preset in bf16, steps only (no checkpoint or validation).
FIXED = {
    "seed": 0,
    "train.optim.epochs": 1000,
    "train.optim.precision": "bf16",
    "train.optim.warmup_steps": 200,
    "train.checkpoint.checkpoint_every_steps": 10**6,
    "train.checkpoint.validate_every_steps": 10**6,
}


def settings_for(data: Path, args: argparse.Namespace, **overrides):
    """The real-corpus preset's TrainingSettings on ``data`` with :data:`FIXED`, the probe's padding and
    ``overrides`` (dotted keys)."""
    from asrflow.presets import preset_params
    from bench.common import train_settings

    preset = preset_params(repo_params(), REPO / "presets" / "real-corpus.yaml")
    changes = FIXED | {"train.data.pad_frames_to": args.pad_frames_to} | overrides
    if args.attention:
        changes["train.model.attention"] = args.attention
    return train_settings(preset, quick=args.quick, data=data, overrides=changes)


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class BareSteps:
    """The model, optimizer and bf16 policy the Trainer builds for ``settings``, stepping planned batches, with
    the Trainer's attention kernels (cuDNN's too with ``cudnn_attention``)."""

    def __init__(self, data: Path, settings, device, *, cudnn_attention: bool = False):
        import torch

        from asrflow.training.assemble import use_shape_free_attention
        from asrflow.training.precision import resolve_precision
        from bench.train_throughput import PlannedBatches, build

        if device.type == "cuda" and not cudnn_attention:
            use_shape_free_attention()  # as the Trainer's process
        self.device = device
        self.planned = PlannedBatches(data, settings, seed=0)
        vocab_size = self.planned.tokenizer.vocab_size
        self.model, self.optimizer = build(settings.train, settings.features, 0, vocab_size)
        self.model.to(device)
        capability = torch.cuda.get_device_capability() if device.type == "cuda" else None
        self.precision = resolve_precision("bf16", device.type, capability)

    def next_steps(self, count: int) -> list[list[dict]]:
        return [self.planned.next_step() for _ in range(count)]

    def run(self, micro_batches: list[dict]) -> float:
        """One bare step on ``micro_batches`` (moved to the device); its wall seconds, the device synchronised."""
        from bench.train_throughput import bare_step

        batches = [on_device(batch, self.device) for batch in micro_batches]
        synchronize()
        start = time.perf_counter()
        bare_step(self.model, self.optimizer, batches, self.precision)
        synchronize()
        return time.perf_counter() - start


def audio_seconds(steps: list[list[dict]]) -> float:
    return sum(float(batch["durations"].sum()) for micro in steps for batch in micro)


def shape_of(micro_batches: list[dict]) -> tuple:
    return tuple(tuple(batch["features"].shape[:2]) for batch in micro_batches)


def memory_counters() -> dict:
    """The CUDA caching allocator's cudaMalloc calls and retries (after freeing its cache) so far."""
    import torch

    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {"cuda_mallocs": stats.get("segment.all.allocated", 0), "alloc_retries": stats.get("num_alloc_retries", 0)}


def bare(data: Path, args, device) -> dict:
    """First pass against second pass of bare steps; new shapes against seen ones in the first."""
    runner = BareSteps(data, settings_for(data, args), device, cudnn_attention=args.cudnn_attention)
    steps = runner.next_steps(args.steps)
    seen: set = set()
    new_s, seen_s = [], []
    for micro in steps:
        seconds = runner.run(micro)
        shape = shape_of(micro)
        (seen_s if shape in seen else new_s).append(seconds)
        seen.add(shape)
    first = new_s + seen_s
    after_first = memory_counters()
    second = [runner.run(micro) for micro in steps]
    audio = audio_seconds(steps)
    record = {"steps": len(steps), "distinct_shapes": len(seen), "audio_s": audio}
    record |= {"first_pass_audio_s_per_s": audio / sum(first), "second_pass_audio_s_per_s": audio / sum(second)}
    record["first_to_second"] = sum(second) / sum(first)
    record |= {"mean_new_shape_step_s": sum(new_s) / len(new_s), "new_shape_steps": len(new_s)}
    record |= {"mean_seen_shape_step_s": sum(seen_s) / len(seen_s) if seen_s else None}
    record["mean_second_pass_step_s"] = sum(second) / len(second)
    return record | {f"{key}_after_first_pass": value for key, value in after_first.items()} | memory_counters()


def trainer(data: Path, args, device) -> dict:
    """The Trainer's first pass against a warm one (the same batches again, in the same process)."""
    from bench.common import train_until

    settings = settings_for(data, args, **extra_overrides(args))
    record: dict = {"on_the_fly": args.on_the_fly, "num_workers": args.num_workers}
    for name in ("first", "warm"):
        results: list = []

        def stop(result, results=results) -> bool:
            results.append(result)
            return len(results) >= args.steps - 1 or sum(r.elapsed_s for r in results[1:]) > args.seconds

        train_until(data, Path(args.workdir) / f"trainer-{name}-{time.time_ns()}", settings, after_step=stop)
        timed = results[1:]
        elapsed = sum(r.elapsed_s for r in timed)
        record[f"{name}_steps"] = len(results)
        record[f"{name}_audio_s_per_s"] = sum(r.audio_seconds for r in timed) / elapsed
        record[f"{name}_data_wait_fraction"] = sum(r.data_wait_s for r in timed) / elapsed
        record[f"{name}_all_finite"] = all(r.finite for r in results)
        if args.once:
            break
    if "warm_audio_s_per_s" in record:
        record["first_to_warm"] = record["first_audio_s_per_s"] / record["warm_audio_s_per_s"]
    return record


def extra_overrides(args) -> dict:
    changes: dict = {}
    if args.on_the_fly:
        changes |= {"features.on_the_fly": True, "train.data.speed_perturb": True}
    if args.num_workers is not None:
        changes["run.num_workers"] = args.num_workers if args.num_workers == "auto" else int(args.num_workers)
    return changes


def sizes(data: Path, args, device) -> list[dict]:
    """Bare-step speed, MFU and peak memory at each batch size, until one fails."""
    import torch

    from bench.train_throughput import model_flops

    records = []
    for size in args.sizes:
        record: dict = {"max_duration_s": size}
        try:
            settings = settings_for(data, args, **{"train.data.max_duration_s": size})
            runner = BareSteps(data, settings, device, cudnn_attention=args.cudnn_attention)
            steps = runner.next_steps(3)
            if not records:
                batch = on_device(steps[0][0], device)
                args.flops = model_flops(runner.model, batch) / float(batch["durations"].sum())
            for micro in steps:  # every shape met once, untimed
                runner.run(micro)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            seconds = sum(runner.run(micro) for micro in steps + steps)
            rate = 2 * audio_seconds(steps) / seconds
            record |= {"audio_s_per_s": rate, "flops_per_audio_s": args.flops, "mfu": args.flops * rate / args.peak}
            record["utterances_per_batch"] = [len(micro[0]["cut_ids"]) for micro in steps]
            if device.type == "cuda":
                record["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
            del runner
        except Exception as error:  # noqa: BLE001 - the failure is the figure
            record |= {"status": "failed", "error": f"{type(error).__name__}: {str(error)[:300]}"}
            records.append(record)
            break
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        records.append(record)
    return records


def profile(data: Path, args, device) -> dict:
    """The operators with the most host time over the first ``--steps`` bare steps of a fresh process."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    runner = BareSteps(data, settings_for(data, args), device, cudnn_attention=args.cudnn_attention)
    steps = runner.next_steps(args.steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        seconds = sum(runner.run(micro) for micro in steps)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    top = [{"op": e.key, "calls": e.count, "self_cpu_s": e.self_cpu_time_total / 1e6} for e in events]
    if args.out:
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        Path(args.out).write_text(table)
    return {"steps": len(steps), "seconds": seconds, "top_host_ops": top}


def decode(data: Path, args, device) -> dict:
    """The evaluate stage's decoding (greedy) of ``--steps`` train utterances with the preset's model (drawn
    weights) on the CPU and on ``device``: real-time factors and whether the transcripts agree."""
    import copy

    from asrflow.data.manifests import load_cuts
    from asrflow.evaluation.evaluate import EvaluateConfig, decode_split
    from asrflow.serving.bundle import Bundle
    from bench.common import bench_train_data
    from bench.train_throughput import build

    settings = settings_for(data, args)
    built = bench_train_data(data, settings, seed=0)
    model = build(settings.train, settings.features, 0, built.tokenizer.vocab_size)[0].eval()
    cuts = load_cuts(data / "fbank", "train").to_eager().subset(first=args.steps)
    config = EvaluateConfig(max_batch_duration_s=args.batch_seconds)
    record: dict = {"utterances": len(cuts), "audio_s": sum(cut.duration for cut in cuts)}
    hyps = {}
    for where in ("cpu", device.type):
        on = copy.deepcopy(model).to(where)
        bundle = Bundle(
            model=on, tokenizer=built.tokenizer, features=settings.features, mvn=built.mvn, run_id=None, info={}
        )
        decode_split(bundle, cuts.subset(first=4), config)  # kernels and plans set up, untimed
        hyps[where], rtf = decode_split(bundle, cuts, config)
        record[f"rtf_total_{where}"], record[f"rtf_encoder_{where}"] = rtf["total"], rtf["encoder"]
    same = sum(hyps["cpu"][key] == hyps[device.type][key] for key in hyps["cpu"])
    return record | {"same_transcripts": same, "batch_seconds": args.batch_seconds}


def restore_old_norm() -> None:
    """ConvFrameNorm as it was: ``nn.LayerNorm((C, F))`` itself (to show the CUDA failure it avoids)."""
    from asrflow.model import conformer_ctc

    conformer_ctc.ConvFrameNorm.forward = lambda self, x: self.norm(x.transpose(1, 2)).transpose(1, 2)


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["bare", "trainer", "sizes", "profile", "decode"])
    parser.add_argument("--data", type=Path, required=True, help="a prepared corpus (generated_data's folder)")
    parser.add_argument("--workdir", default="/tmp", help="where the Trainer's runs are written")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=1e9, help="trainer: timed seconds per pass at most")
    parser.add_argument("--once", action="store_true", help="trainer: the first pass only")
    parser.add_argument("--pad-frames-to", type=int, default=1)
    parser.add_argument("--no-cudnn", action="store_true")
    parser.add_argument("--cudnn-attention", action="store_true", help="bare, sizes, profile: cuDNN's SDPA too")
    parser.add_argument("--attention", choices=ATTENTION_KINDS, help="train.model.attention (default: the preset's)")
    parser.add_argument("--old-norm", action="store_true")
    parser.add_argument("--cuda-alloc-conf", help="PYTORCH_CUDA_ALLOC_CONF for this process")
    parser.add_argument("--on-the-fly", action="store_true", help="trainer: fbank and speed perturbation on the fly")
    parser.add_argument("--num-workers", help="trainer: run.num_workers (auto or an integer)")
    parser.add_argument("--sizes", type=float, nargs="+", default=[600.0, 1200.0, 2400.0, 4800.0])
    parser.add_argument("--peak", type=float, default=1.0, help="sizes: the measured bf16 FLOP/s")
    parser.add_argument("--out", help="profile: write the full table here")
    parser.add_argument("--batch-seconds", type=float, default=200.0, help="decode: evaluate.max_batch_duration_s")
    parser.add_argument("--quick", action="store_true", help="the tiny model (a CPU check of the probe)")
    args = parser.parse_args(argv)
    if args.cuda_alloc_conf:  # read when CUDA's caching allocator starts, at the first allocation
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.cuda_alloc_conf
    if args.no_cudnn:
        torch.backends.cudnn.enabled = False
    if args.old_norm:
        restore_old_norm()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    variant = {"pad_frames_to": args.pad_frames_to, "cudnn": not args.no_cudnn, "old_norm": args.old_norm}
    variant |= {"cudnn_attention": args.cudnn_attention, "attention": args.attention or "preset"}
    variant |= {"cuda_alloc_conf": args.cuda_alloc_conf} if args.cuda_alloc_conf else {}
    kinds = {"bare": bare, "trainer": trainer, "sizes": sizes, "profile": profile, "decode": decode}
    found = kinds[args.kind](args.data, args, device)
    for record in found if isinstance(found, list) else [found]:
        print(json.dumps({"benchmark": f"gpu_{args.kind}", **variant, **record}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
