"""Training throughput of the real train loop against the bare model step; data waiting; FLOPs and MFU.

``python -m bench.train_throughput [--quick] [--workdir DIR] [--num-threads N] [--precisions [--steps N]]``:
the Trainer as the train stage runs it and, after each of its steps, a bare step (forward, CTC, backward, AdamW)
of a second model copy on the same batches. Records ``matmul_fp32``, ``train_throughput`` (``loop_audio_s_per_s``,
``bare_audio_s_per_s``, ``ratio``, FLOPs per audio second, MFU) and ``data_wait``. ``--precisions``: instead,
bare steps in fp32, bf16 and fp16 autocast side by side, params.yaml's and the real-corpus preset's model (what
``precision: auto`` picks on this CPU): ``cpu_precision`` per case and precision (``audio_s_per_s``,
``ratio_to_fp32``). ``--compile``: instead, bare fp32 steps of the eager model against ``torch.compile``'s
(dynamic shapes, then static ones) on the same batches of params.yaml's model, frames padded to 64 for both:
``cpu_compile`` per step (seconds each side, the batch shape) and per mode (the error that stopped it, if any).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from dataclasses import replace
from pathlib import Path

from bench.common import (
    bench_train_data,
    emit,
    machine,
    matmul_flops,
    parse_args,
    ratio,
    train_settings,
    train_until,
    workdir,
)
from tests.support.corpora import generated_data, yesno_data
from tests.support.repo import REPO, repo_params

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
    """The batches the train loop will draw (the same ``TrainData`` the Trainer builds for ``settings``, a
    TrainingSettings, at ``seed``), made in this process."""

    def __init__(self, data: Path, settings, seed: int):
        built = bench_train_data(data, settings, seed=seed)
        self.tokenizer, self.dataset = built.tokenizer, built.dataset
        self.items = iter(built.batches)
        self.accum_grad = settings.train.optim.accum_grad

    def next_step(self) -> list[dict]:
        """The micro-batches of the next optimizer step."""
        return [self.dataset[next(self.items)] for _ in range(self.accum_grad)]


def build(settings, vocab_size: int):
    """The model and optimizer the Trainer builds for ``settings`` (TrainingSettings), through the same factory
    and seeded the same way, in train mode."""
    import torch

    from asrflow.training.parts import RunPlace, build_run_model, build_step_context
    from asrflow.training.run_state import seed_everything

    seed_everything(settings.seed)
    model = build_run_model(settings, vocab_size=vocab_size)
    optimizer = build_step_context(settings, model, RunPlace.single(torch.device("cpu"))).optimizer
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


def run_paired(data: Path, exp: Path, *, tracking_uri, settings, max_steps, budget_s):
    """The Trainer of ``settings`` (TrainingSettings), with a bare step after each of its steps; per-step records,
    and FLOPs/audio s."""
    planned = PlannedBatches(data, settings, settings.seed)
    bare_model, bare_optimizer = build(settings, planned.tokenizer.vocab_size)
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

    train_until(data, exp, settings, after_step=paired, uri=tracking_uri)
    return records, flops_per_audio_s


def measure(corpus: str, data: Path, *, work: Path, quick: bool, max_steps, budget_s, peak, num_threads=None):
    """One corpus: the ``train_throughput`` and ``data_wait`` records."""
    overrides = {"train.optim.epochs": 1000} | ({"train.optim.num_threads": num_threads} if num_threads else {})
    settings = train_settings(repo_params(), quick=quick, data=data, overrides=overrides)
    exp = work / f"train-throughput-{corpus}"
    shutil.rmtree(exp, ignore_errors=True)
    run = {"tracking_uri": f"sqlite:///{work / 'bench-mlflow.db'}", "settings": settings}
    records, flops = run_paired(data, exp, max_steps=max_steps, budget_s=budget_s, **run)
    timed = records[1:]
    total = {key: sum(r[key] for r in timed) for key in ("audio_s", "bare_s", "elapsed", "waited")}
    audio = total["audio_s"]
    # the loop's wall time less this benchmark's own work after each step (the bare batch and steps)
    loop_rate = audio / (records[-1]["t"] - records[0]["t"] - sum(r["hook_s"] for r in records[:-1]))
    bare_rate, wait = audio / total["bare_s"], total["waited"] / total["elapsed"]
    per_step = [r["bare_s"] / r["elapsed"] for r in timed]
    train, num_workers = settings.train, settings.run.num_workers
    shown = {k: getattr(train.model, k) for k in ("d_model", "num_heads", "ffn_dim", "num_layers", "conv_kernel_size")}
    shown |= {"max_duration_s": train.data.max_duration_s, "num_buckets": train.data.num_buckets}
    shown |= {"accum_grad": train.optim.accum_grad, "num_threads": train.optim.num_threads}
    shown |= {"num_workers": num_workers, "precision": train.optim.precision}
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
    waits |= {"goal": "data_wait_fraction <= 0.02", "meets_goal": wait <= 0.02, "num_workers": num_workers}
    return [{**loop, "settings": shown}, waits]


PRECISIONS = ("fp32", "bf16", "fp16")
#: Padded seconds per batch of the preset's model here (its own 600 s is sized for a GPU).
PRESET_BATCH_S = 60.0


def precision_cases(work: Path, quick: bool, steps: int) -> list[tuple[str, Path, object, int]]:
    """(name, data folder, TrainingSettings, timed batches) per case of ``--precisions``."""
    from asrflow.params import flatten
    from asrflow.presets import preset_params

    params = repo_params()

    def settings(data: Path, changes: dict | None = None):
        overrides = {"train.optim.epochs": 1000} | (changes or {})
        return train_settings(params, quick=quick, data=data, overrides=overrides)

    if quick:
        data = generated_data(work, 200)
        return [("generated, tiny model", data, settings(data), 1)]
    yesno, generated = yesno_data(work), generated_data(work, 300)
    preset = preset_params(params, REPO / "presets" / "real-corpus.yaml")
    preset_model = flatten({"train": {"model": preset["train"]["model"]}})  # the preset's train.model, whole
    preset_model["train.data.max_duration_s"] = PRESET_BATCH_S
    return [
        ("yesno, params.yaml model", yesno, settings(yesno), steps),
        ("generated, params.yaml model", generated, settings(generated), steps),
        ("generated, real-corpus preset model", generated, settings(generated, preset_model), max(2, steps // 2)),
    ]


def measure_precisions(name: str, data: Path, settings, *, timed: int, threads: int) -> list[dict]:
    """Every precision's bare step time on the same ``timed`` batches (plus one warm-up); one record each."""
    import torch

    from asrflow.model.conformer_ctc import count_parameters
    from asrflow.training.precision import resolve_precision

    torch.set_num_threads(threads)  # no Trainer here: bare steps only
    planned = PlannedBatches(data, settings, seed=0)
    vocab, seeded = planned.tokenizer.vocab_size, replace(settings, seed=0)
    runs = {p: (resolve_precision(p, "cpu", None), *build(seeded, vocab)) for p in PRECISIONS}
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


def measure_compile(data: Path, settings, *, steps: int, threads: int) -> list[dict]:
    """Bare fp32 steps of the eager model and of ``torch.compile(model, dynamic=...)`` on the same ``steps``
    batches, for dynamic shapes and static ones; per step the seconds of each (a compiled step includes
    compiling it for a new shape), or the error that stopped the compiled side."""
    import torch

    torch.set_num_threads(threads)
    records = []
    for dynamic in (True, False):
        planned = PlannedBatches(data, settings, seed=0)
        vocab = planned.tokenizer.vocab_size
        eager, eager_optimizer = build(replace(settings, seed=0), vocab)
        model, optimizer = build(replace(settings, seed=0), vocab)
        compiled = torch.compile(model, dynamic=dynamic)
        common = {"benchmark": "cpu_compile", "dynamic": dynamic, "threads": threads, "torch": torch.__version__}
        for step in range(steps):
            batches = planned.next_step()
            shape = list(batches[0]["features"].shape)
            eager_s = bare_step(eager, eager_optimizer, batches)
            try:
                compiled_s = bare_step(compiled, optimizer, batches)
            except Exception as error:  # noqa: BLE001 - the compiler's failure is the finding
                records.append(emit({**common, "step": step, "shape": shape, "error": str(error).splitlines()[0]}))
                break
            records.append(emit({**common, "step": step, "shape": shape, "eager_s": eager_s, "compiled_s": compiled_s}))
    return records


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser) -> None:
        parser.add_argument("--num-threads", type=int, help="torch threads (default: train.optim.num_threads)")
        parser.add_argument("--precisions", action="store_true", help="fp32 / bf16 / fp16 bare steps instead")
        parser.add_argument("--steps", type=int, default=6, help="--precisions, --compile: batches (default 6)")
        parser.add_argument("--compile", action="store_true", help="eager against torch.compile bare steps instead")

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    mode = "quick" if args.quick else "full"
    threads = args.num_threads or train_settings(repo_params(), quick=args.quick).train.optim.num_threads
    with workdir(args.workdir) as work:
        if args.compile:
            data = generated_data(work, GENERATED[mode])
            overrides = {"train.optim.epochs": 1000, "train.data.pad_frames_to": 64}
            settings = train_settings(repo_params(), quick=args.quick, data=data, overrides=overrides)
            return [
                emit({"benchmark": "machine", **machine()}),
                *measure_compile(data, settings, steps=args.steps, threads=threads),
            ]
        if args.precisions:
            from asrflow.training.precision import resolve_precision

            auto = resolve_precision("auto", "cpu", None).name
            out = [emit({"benchmark": "machine", **machine(), "auto_picks": auto})]
            for name, data, settings, timed in precision_cases(work, args.quick, args.steps):
                out += [emit(r) for r in measure_precisions(name, data, settings, timed=timed, threads=threads)]
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
