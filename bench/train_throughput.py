"""Training throughput of the real train loop vs the bare model step; data waiting; FLOPs and MFU.

For each corpus (the shipped yesno corpus, and a generated corpus of utterances of 1-15 s,
features precomputed) this runs :class:`asrflow.training.trainer.Trainer` as the train
stage does (params.yaml's ``train:`` section: model, ``num_workers`` data workers,
augmentation, guards, scheduler, MLflow recording into a throw-away SQLite store), and
right after each of its optimizer steps, in the same process, the **bare step** (the
baseline): a second copy of the same model (same seed, same thread count) doing forward,
CTC loss, backward and AdamW on the very batch the loop just used, loaded into memory
beforehand (the plan is deterministic). Pairing the two step by step means both see the
same load from other processes on the machine. The loop stops itself through its own stop
request (the path SIGTERM takes) after ``max_steps`` steps or once its time budget is
spent. Step 1 (start-up, worker spawn) is left out of every figure.

Figures (record ``train_throughput``):

* ``loop_audio_s_per_s``: audio seconds of steps 2..N / wall seconds from the end of step
  1 to the end of step N, less the time spent in this benchmark's work after each step
  (building the bare step's batch, the bare steps), so all the loop's own bookkeeping counts;
* ``loop_metric_audio_s_per_s``: the same audio / the summed step times the loop logs as
  ``train/audio_s_per_s`` (data wait + step);
* ``bare_audio_s_per_s``: the same audio / the bare steps' time; ``ratio`` = loop / bare
  (goal >= 0.9);
* ``flops_per_audio_s``: model FLOPs (``torch.utils.flop_counter.FlopCounterMode``:
  matmuls, convolutions, attention) of one forward + backward of the first batch / its
  audio seconds; ``matmul_flops``: the measured fp32 ``torch.mm`` 2048 x 2048 rate at the
  same thread count (record ``matmul_fp32``); ``mfu_loop`` / ``mfu_bare`` = achieved
  model FLOP/s / that rate.

Record ``data_wait``: summed data wait / summed step time over steps 2..N, i.e. the loop's
``train/data_wait_fraction`` (goal <= 0.02); its baseline is the bare step's 0 (batches in
memory).

Without ``--quick``, a third copy of the model also takes each step at one thread
(``bare_1_thread_audio_s_per_s``, and ``bare_1_thread_speedup`` over the bare step at
``num_threads``): on 2 busy cores a second torch thread can cost more than it gives.
With ``--quick`` the model is tiny and only the generated corpus runs, for 2 steps (1
timed): it only checks that the benchmark works.

Usage: ``python -m bench.train_throughput [--quick] [--workdir DIR] [--num-threads N]``
(``--num-threads`` overrides ``train.num_threads`` for both the loop and the bare step).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from dataclasses import replace
from pathlib import Path

from asrflow.testing.corpora import data_features, generated_data, yesno_data
from asrflow.testing.repo import repo_params
from bench.common import emit, machine, matmul_flops, parse_args, ratio, rounded, workdir

#: Utterances of the generated corpus, per mode (the yesno corpus is fixed).
GENERATED = {"full": 2000, "quick": 200}
#: (corpus, max optimizer steps, time budget in seconds for the paired steps), per mode.
PLANS = {
    "full": [("yesno", 12, 30.0), ("generated", 16, 60.0)],
    "quick": [("generated", 2, 30.0)],
}
#: Steps run whatever the budget says (1 warm-up + at least 3 timed).
MIN_STEPS = 4
#: The --quick model (only checks that the benchmark runs).
TINY_MODEL = {"d_model": 32, "num_heads": 2, "ffn_dim": 64, "num_layers": 1, "conv_kernel_size": 7}


def configs(quick: bool, num_threads: int | None = None):
    """params.yaml and its TrainConfig (tiny model with ``quick``). The features are those each
    corpus was computed with (:func:`bench.common.data_features`)."""
    from asrflow.training.config import load_train_config

    params = repo_params()
    train = load_train_config(params)
    # Enough epochs for any step count (the loop is stopped), one process.
    train = replace(train, epochs=1000, nproc_per_node=1, nnodes=1, **(TINY_MODEL if quick else {}))
    if num_threads:
        train = replace(train, num_threads=num_threads)
    return params, train


class PlannedBatches:
    """The batches the train loop will draw (the same ``TrainData`` the Trainer builds), made in this process."""

    def __init__(self, data: Path, config, features, seed: int):
        from asrflow.training.train_data import TrainData

        train_data = TrainData.build(config, features, seed=seed, fbank_dir=data / "fbank", lang_dir=data / "lang")
        self.tokenizer = train_data.tokenizer
        self.dataset = train_data.dataset
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
    """Forward, CTC loss, backward over the micro-batches, then the optimizer step; wall seconds.

    ``precision``: a :class:`~asrflow.training.precision.PrecisionPolicy` whose autocast the
    forward pass runs under, as the train loop's does (None: fp32).
    """
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


def run_paired(
    data: Path,
    exp: Path,
    *,
    tracking_uri: str,
    params: dict,
    config,
    features,
    seed: int,
    max_steps: int,
    budget_s: float,
    one_thread_check: bool,
) -> tuple[list[dict], float]:
    """The Trainer, with a bare step after each of its steps; per-step records, and FLOPs/audio s."""
    import torch

    from asrflow.training.config import TrainPaths
    from asrflow.training.observers import TrainObserver
    from asrflow.training.trainer import Trainer

    planned = PlannedBatches(data, config, features, seed)
    bare_model, bare_optimizer = build(config, features, seed, planned.tokenizer.vocab_size)
    single = build(config, features, seed, planned.tokenizer.vocab_size) if one_thread_check else None
    first = planned.next_step()
    flops_per_audio_s = model_flops(bare_model, first[0]) / float(first[0]["durations"].sum())
    pending = [first]
    records: list[dict] = []
    started = []

    class PairedSteps(TrainObserver):
        """After each of the Trainer's steps, a bare step on the same batches."""

        def after_step(self, run, result):
            now = time.perf_counter()
            batches = pending.pop() if pending else planned.next_step()
            ids = [cut_id for batch in batches for cut_id in batch["cut_ids"]]
            bare_s = bare_step(bare_model, bare_optimizer, batches)
            single_s = 0.0
            if single is not None:
                torch.set_num_threads(1)
                single_s = bare_step(*single, batches)
                torch.set_num_threads(config.num_threads)
            if not started:
                started.append(time.perf_counter())
            records.append(
                {
                    "t": now,
                    "audio_s": result.audio_seconds,
                    "waited": result.data_wait_s,
                    "elapsed": result.elapsed_s,
                    "padding": result.padding_ratio,
                    "bare_s": bare_s,
                    "single_s": single_s,
                    "same_batch": ids == list(result.cut_ids),
                    "hook_s": time.perf_counter() - now,
                }
            )
            steps = result.step
            spent = time.perf_counter() - started[0]
            if steps >= max_steps - 1 or (steps >= MIN_STEPS - 1 and spent / (steps - 1) * steps > budget_s):
                run.stop.request()  # the next step is the last one, then a checkpoint (as on SIGTERM)

    paths = TrainPaths.under(exp, fbank_dir=data / "fbank", lang_dir=data / "lang")
    Trainer(
        config,
        features,
        seed=seed,
        all_params=params,
        paths=paths,
        tracking_uri=tracking_uri,
        observers=[PairedSteps()],
    ).run()  # returns when finished or stopped (as on SIGTERM)
    torch.set_num_threads(config.num_threads)
    return records, flops_per_audio_s


def measure(
    corpus: str,
    data: Path,
    *,
    work: Path,
    quick: bool,
    max_steps: int,
    budget_s: float,
    peak: float,
    num_threads: int | None = None,
) -> list[dict]:
    """One corpus: returns the records to print."""
    import torch

    params, config = configs(quick, num_threads)
    features = data_features(data)
    seed = int(params.get("seed", 0))
    torch.set_num_threads(config.num_threads)
    exp = work / f"train-throughput-{corpus}"
    shutil.rmtree(exp, ignore_errors=True)
    records, flops_per_audio_s = run_paired(
        data,
        exp,
        tracking_uri=f"sqlite:///{work / 'bench-mlflow.db'}",
        params=params,
        config=config,
        features=features,
        seed=seed,
        max_steps=max_steps,
        budget_s=budget_s,
        one_thread_check=not quick,
    )
    timed = records[1:]
    audio = sum(r["audio_s"] for r in timed)
    # the loop's wall time: from the end of step 1 to the end of step N, less this benchmark's
    # own work after each step (building the bare batch, the bare steps)
    loop_wall = records[-1]["t"] - records[0]["t"] - sum(r["hook_s"] for r in records[:-1])
    loop_rate = audio / loop_wall
    bare_rate = audio / sum(r["bare_s"] for r in timed)
    step_time = sum(r["elapsed"] for r in timed)
    wait = sum(r["waited"] for r in timed) / step_time
    settings = {
        k: getattr(config, k)
        for k in (
            "d_model",
            "num_heads",
            "ffn_dim",
            "num_layers",
            "conv_kernel_size",
            "max_duration_s",
            "num_buckets",
            "accum_grad",
            "num_threads",
            "num_workers",
            "precision",
        )
    }
    common = {
        "corpus": corpus,
        "steps": len(records),
        "timed_steps": len(timed),
        "same_batches": all(r["same_batch"] for r in records),
        "audio_s_timed": rounded(audio),
    }
    return [
        {
            "benchmark": "train_throughput",
            **common,
            "loop_audio_s_per_s": rounded(loop_rate),
            "loop_metric_audio_s_per_s": rounded(audio / step_time),
            "bare_audio_s_per_s": rounded(bare_rate),
            "ratio": rounded(ratio(loop_rate, bare_rate)),
            "goal": "ratio >= 0.9",
            "meets_goal": ratio(loop_rate, bare_rate) >= 0.9,
            "per_step_ratio_min_max": [
                rounded(min(r["audio_s"] / r["elapsed"] / (r["audio_s"] / r["bare_s"]) for r in timed)),
                rounded(max(r["audio_s"] / r["elapsed"] / (r["audio_s"] / r["bare_s"]) for r in timed)),
            ],
            **(
                {}
                if quick
                else {
                    "bare_1_thread_audio_s_per_s": rounded(audio / sum(r["single_s"] for r in timed)),
                    "bare_1_thread_speedup": rounded(
                        ratio(sum(r["bare_s"] for r in timed), sum(r["single_s"] for r in timed))
                    ),
                }
            ),
            "flops_per_audio_s": rounded(flops_per_audio_s),
            "matmul_flops": rounded(peak),
            "achieved_flops_loop": rounded(flops_per_audio_s * loop_rate),
            "achieved_flops_bare": rounded(flops_per_audio_s * bare_rate),
            "mfu_loop": rounded(ratio(flops_per_audio_s * loop_rate, peak)),
            "mfu_bare": rounded(ratio(flops_per_audio_s * bare_rate, peak)),
            "loop_padding_ratio": rounded(sum(r["padding"] * r["audio_s"] for r in timed) / max(audio, 1e-9)),
            "settings": settings,
        },
        {
            "benchmark": "data_wait",
            **common,
            "data_wait_fraction": rounded(wait),
            "baseline": 0.0,
            "per_step_max": rounded(max(r["waited"] / r["elapsed"] for r in timed)),
            "first_step_wait_s": rounded(records[0]["waited"]),
            "goal": "data_wait_fraction <= 0.02",
            "meets_goal": wait <= 0.02,
            "num_workers": config.num_workers,
        },
    ]


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(
        __doc__.splitlines()[0],
        argv,
        lambda parser: parser.add_argument(
            "--num-threads",
            type=int,
            default=None,
            help="override train.num_threads for the loop and the bare step (default: params.yaml's)",
        ),
    )
    mode = "quick" if args.quick else "full"
    out = []
    with workdir(args.workdir) as work:
        threads = configs(args.quick, args.num_threads)[1].num_threads
        peak = matmul_flops(threads=threads)
        out.append(
            emit(
                {
                    "benchmark": "matmul_fp32",
                    "size": 2048,
                    "threads": threads,
                    "flops": rounded(peak),
                    "flops_1_thread": rounded(matmul_flops(threads=1)),
                    "machine": machine(),
                }
            )
        )
        for corpus, max_steps, budget_s in PLANS[mode]:
            data = yesno_data(work) if corpus == "yesno" else generated_data(work, GENERATED[mode])
            for record in measure(
                corpus,
                data,
                work=work,
                quick=args.quick,
                max_steps=max_steps,
                budget_s=budget_s,
                peak=peak,
                num_threads=args.num_threads,
            ):
                out.append(emit({**record, "mode": mode}))
    return out


if __name__ == "__main__":
    main()
