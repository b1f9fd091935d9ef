"""Training throughput of the real train loop against the bare model step; data waiting; FLOPs and MFU.

``python -m bench.train_throughput [--quick] [--workdir DIR] [--num-threads N] [--precisions [--steps N]]``:
the Trainer as the train stage runs it and, after each of its steps, a bare step (forward, CTC, backward, AdamW)
of a second model copy on the same batches. Records ``matmul_fp32``, ``train_throughput`` (``loop_audio_s_per_s``,
``bare_audio_s_per_s``, ``ratio``, FLOPs per audio second, MFU) and ``data_wait``. ``--precisions``: instead,
bare steps in fp32, bf16 and fp16 autocast side by side, params.yaml's and the real-corpus preset's model (what
``precision: auto`` picks on this CPU): ``cpu_precision`` per case and precision (``audio_s_per_s``,
``ratio_to_fp32``).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from dataclasses import replace
from pathlib import Path

from asrflow.testing.corpora import data_features, generated_data, yesno_data
from asrflow.testing.repo import REPO, repo_params
from bench.common import emit, machine, matmul_flops, parse_args, ratio, run_trainer, train_config, workdir

#: Utterances of the generated corpus, per mode (the yesno corpus is fixed).
GENERATED = {"full": 2000, "quick": 200}
#: (corpus, max optimizer steps, time budget in seconds for the paired steps), per mode.
PLANS = {
    "full": [("yesno", 12, 30.0), ("generated", 16, 60.0)],
    "quick": [("generated", 2, 30.0)],
}
#: Steps run whatever the budget says (1 warm-up + at least 3 timed).
MIN_STEPS = 4


class PlannedBatches:
    """The batches the train loop will draw (the same ``TrainData`` the Trainer builds), made in this process."""

    def __init__(self, data: Path, config, features, seed: int):
        from asrflow.training.train_data import TrainData

        train_data = TrainData.build(config, features, seed=seed, fbank_dir=data / "fbank", lang_dir=data / "lang")
        self.tokenizer, self.dataset = train_data.tokenizer, train_data.dataset
        self.items = iter(train_data.batches)
        self.accum_grad = config.accum_grad

    def next_step(self) -> list[dict]:
        """The micro-batches of the next optimizer step."""
        return [self.dataset[next(self.items)] for _ in range(self.accum_grad)]


def build(config, features, seed: int, vocab_size: int):
    """The model and optimizer the Trainer builds (params.yaml's whole model shape), seeded the same way."""
    from asrflow.model.conformer_ctc import build_model
    from asrflow.training.run_state import seed_everything
    from asrflow.training.step import build_optimizer

    seed_everything(seed)
    model = build_model(config.model(features.num_mel_bins, vocab_size))
    optimizer = build_optimizer(model, lr=config.lr, weight_decay=config.weight_decay)
    model.train()
    return model, optimizer


def bare_step(model, optimizer, micro_batches: list[dict], precision=None) -> float:
    """Forward (under ``precision``'s autocast, a PrecisionPolicy, as the loop's; None: fp32), CTC loss, backward
    over the micro-batches, then the optimizer step; wall seconds."""
    from asrflow.training.step import ctc_loss_sum

    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    tokens = micro_batches[0]["step_tokens"]
    for batch in micro_batches:
        with precision.autocast() if precision is not None else contextlib.nullcontext():
            log_probs, out_lens = model(batch["features"], batch["feature_lens"])  # (N, T', V), (N,)
        (ctc_loss_sum(log_probs, out_lens, batch) / tokens).backward()
    optimizer.step()
    return time.perf_counter() - start


def model_flops(model, batch: dict) -> float:
    """FLOPs of one forward + backward of ``batch`` (FlopCounterMode)."""
    from torch.utils.flop_counter import FlopCounterMode

    from asrflow.training.step import ctc_loss_sum

    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        log_probs, out_lens = model(batch["features"], batch["feature_lens"])
        ctc_loss_sum(log_probs, out_lens, batch).backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def run_paired(data: Path, exp: Path, *, tracking_uri, params, config, features, seed, max_steps, budget_s):
    """The Trainer, with a bare step after each of its steps; per-step records, and FLOPs/audio s."""
    planned = PlannedBatches(data, config, features, seed)
    bare_model, bare_optimizer = build(config, features, seed, planned.tokenizer.vocab_size)
    first = planned.next_step()
    flops_per_audio_s = model_flops(bare_model, first[0]) / float(first[0]["durations"].sum())
    pending, records, started = [first], [], []

    def paired(result) -> bool:
        """A bare step on the batches of the Trainer's step ``result``; whether to stop."""
        now = time.perf_counter()
        batches = pending.pop() if pending else planned.next_step()
        ids = [cut_id for batch in batches for cut_id in batch["cut_ids"]]
        bare_s = bare_step(bare_model, bare_optimizer, batches)
        if not started:
            started.append(time.perf_counter())
        record = {"t": now, "audio_s": result.audio_seconds, "waited": result.data_wait_s, "bare_s": bare_s}
        record |= {"elapsed": result.elapsed_s, "padding": result.padding_ratio}
        records.append({**record, "same_batch": ids == list(result.cut_ids), "hook_s": time.perf_counter() - now})
        steps, spent = result.step, time.perf_counter() - started[0]
        return steps >= max_steps - 1 or (steps >= MIN_STEPS - 1 and spent / (steps - 1) * steps > budget_s)

    run_trainer(data, exp, config, features, params=params, seed=seed, after_step=paired, uri=tracking_uri)
    return records, flops_per_audio_s


def measure(corpus: str, data: Path, *, work: Path, quick: bool, max_steps, budget_s, peak, num_threads=None):
    """One corpus: the ``train_throughput`` and ``data_wait`` records."""
    import torch

    params = repo_params()
    config = train_config(params, quick=quick, epochs=1000, **({"num_threads": num_threads} if num_threads else {}))
    torch.set_num_threads(config.num_threads)
    exp = work / f"train-throughput-{corpus}"
    shutil.rmtree(exp, ignore_errors=True)
    run = {"tracking_uri": f"sqlite:///{work / 'bench-mlflow.db'}", "params": params, "config": config}
    run |= {"features": data_features(data), "seed": int(params.get("seed", 0))}
    records, flops = run_paired(data, exp, max_steps=max_steps, budget_s=budget_s, **run)
    timed = records[1:]
    total = {key: sum(r[key] for r in timed) for key in ("audio_s", "bare_s", "elapsed", "waited")}
    audio = total["audio_s"]
    # the loop's wall time less this benchmark's own work after each step (the bare batch and steps)
    loop_rate = audio / (records[-1]["t"] - records[0]["t"] - sum(r["hook_s"] for r in records[:-1]))
    bare_rate, wait = audio / total["bare_s"], total["waited"] / total["elapsed"]
    per_step = [r["bare_s"] / r["elapsed"] for r in timed]
    names = "d_model num_heads ffn_dim num_layers conv_kernel_size max_duration_s num_buckets accum_grad num_threads"
    settings = {k: getattr(config, k) for k in (*names.split(), "num_workers", "precision")}
    common = {"corpus": corpus, "steps": len(records), "timed_steps": len(timed), "audio_s_timed": audio}
    common["same_batches"] = all(r["same_batch"] for r in records)
    loop = {
        "benchmark": "train_throughput",
        **common,
        "loop_audio_s_per_s": loop_rate,
        "loop_metric_audio_s_per_s": audio / total["elapsed"],
        "bare_audio_s_per_s": bare_rate,
        "ratio": ratio(loop_rate, bare_rate),
        "goal": "ratio >= 0.9",
        "meets_goal": ratio(loop_rate, bare_rate) >= 0.9,
        "per_step_ratio_min_max": [min(per_step), max(per_step)],
        "flops_per_audio_s": flops,
        "matmul_flops": peak,
        "achieved_flops_loop": flops * loop_rate,
        "achieved_flops_bare": flops * bare_rate,
        "mfu_loop": ratio(flops * loop_rate, peak),
        "mfu_bare": ratio(flops * bare_rate, peak),
        "loop_padding_ratio": sum(r["padding"] * r["audio_s"] for r in timed) / max(audio, 1e-9),
    }
    waits = {"benchmark": "data_wait", **common, "data_wait_fraction": wait, "baseline": 0.0}
    waits |= {"per_step_max": max(r["waited"] / r["elapsed"] for r in timed), "first_step_wait_s": records[0]["waited"]}
    waits |= {"goal": "data_wait_fraction <= 0.02", "meets_goal": wait <= 0.02, "num_workers": config.num_workers}
    return [{**loop, "settings": settings}, waits]


PRECISIONS = ("fp32", "bf16", "fp16")
#: Padded seconds per batch of the preset's model here (its own 600 s is sized for a GPU).
PRESET_BATCH_S = 60.0


def precision_cases(work: Path, quick: bool, steps: int) -> list[tuple[str, Path, object, int]]:
    """(name, data folder, TrainConfig, timed batches) per case of ``--precisions``."""
    from asrflow.params import load_params
    from asrflow.testing.tiny_config import TINY_MODEL
    from asrflow.training.config import load_train_config

    train = train_config(repo_params(), quick=quick, epochs=1000)
    if quick:
        return [("generated, tiny model", generated_data(work, 200), train, 1)]
    preset = load_train_config(load_params(REPO / "presets" / "real-corpus.yaml"))
    shape = {key: getattr(preset, key) for key in (*TINY_MODEL, "subsampling_channels")}
    preset, generated = replace(train, **shape, max_duration_s=PRESET_BATCH_S), generated_data(work, 300)
    return [
        ("yesno, params.yaml model", yesno_data(work), train, steps),
        ("generated, params.yaml model", generated, train, steps),
        ("generated, real-corpus preset model", generated, preset, max(2, steps // 2)),
    ]


def measure_precisions(name: str, data: Path, config, *, timed: int, threads: int) -> list[dict]:
    """Every precision's bare step time on the same ``timed`` batches (plus one warm-up); one record each."""
    import torch

    from asrflow.model.conformer_ctc import count_parameters
    from asrflow.training.precision import resolve_precision

    torch.set_num_threads(threads)
    features = data_features(data)
    planned = PlannedBatches(data, config, features, seed=0)
    vocab = planned.tokenizer.vocab_size
    runs = {p: (resolve_precision(p, "cpu", None), *build(config, features, 0, vocab)) for p in PRECISIONS}
    seconds, audio_s = dict.fromkeys(PRECISIONS, 0.0), 0.0
    for index in range(timed + 1):  # the first is a warm-up
        batches = planned.next_step()
        for precision, (policy, model, optimizer) in runs.items():
            seconds[precision] += bare_step(model, optimizer, batches, policy) * bool(index)
        audio_s += sum(float(b["durations"].sum()) for b in batches) * bool(index)
    common = {"benchmark": "cpu_precision", "case": name, "params": count_parameters(runs["fp32"][1])}
    common |= {"threads": threads, "timed_batches": timed, "audio_s_timed": audio_s}
    return [
        {**common, "precision": p, "audio_s_per_s": audio_s / spent, "ratio_to_fp32": ratio(seconds["fp32"], spent)}
        for p, spent in seconds.items()
    ]


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser) -> None:
        parser.add_argument("--num-threads", type=int, help="torch threads (default: train.optim.num_threads)")
        parser.add_argument("--precisions", action="store_true", help="fp32 / bf16 / fp16 bare steps instead")
        parser.add_argument("--steps", type=int, default=6, help="--precisions: timed batches per case (default 6)")

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    mode = "quick" if args.quick else "full"
    threads = args.num_threads or train_config(repo_params(), quick=args.quick).num_threads
    with workdir(args.workdir) as work:
        if args.precisions:
            from asrflow.training.precision import native_bf16_cpu_flags, resolve_precision

            flags = native_bf16_cpu_flags()
            auto = resolve_precision("auto", "cpu", None, flags).name
            out = [emit({"benchmark": "machine", **machine(), "cpu_bf16": list(flags), "auto_picks": auto})]
            for name, data, config, timed in precision_cases(work, args.quick, args.steps):
                out += [emit(r) for r in measure_precisions(name, data, config, timed=timed, threads=threads)]
            return out
        peak = matmul_flops(threads=threads)
        matmul = {"size": 2048, "threads": threads, "flops": peak, "flops_1_thread": matmul_flops(threads=1)}
        out = [emit({"benchmark": "matmul_fp32", **matmul, "machine": machine()})]
        for corpus, max_steps, budget_s in PLANS[mode]:
            data = yesno_data(work) if corpus == "yesno" else generated_data(work, GENERATED[mode])
            limits = {"max_steps": max_steps, "budget_s": budget_s, "peak": peak, "num_threads": args.num_threads}
            out += [emit({**r, "mode": mode}) for r in measure(corpus, data, work=work, quick=args.quick, **limits)]
    return out


if __name__ == "__main__":
    main()
