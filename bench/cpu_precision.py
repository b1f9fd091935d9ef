"""Training steps on the CPU in fp32, bf16 and fp16 autocast, side by side: what ``precision: auto`` picks there.

``python -m bench.cpu_precision [--quick] [--workdir DIR] [--steps N] [--threads N]``: one model copy per
precision, bare steps on the same planned batches in turn. Record ``cpu_precision`` per case and precision:
``audio_s_per_s``, ``ratio_to_fp32``; ``machine`` says whether the CPU has native bf16 and what auto picks.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from asrflow.testing.corpora import data_features, generated_data, yesno_data
from asrflow.testing.repo import REPO, repo_params
from bench.common import emit, machine, parse_args, ratio, rounded, train_config, workdir

PRECISIONS = ("fp32", "bf16", "fp16")
#: Padded seconds per batch of the preset's model here (its own 600 s is sized for a GPU).
PRESET_BATCH_S = 60.0


def cases(work: Path, quick: bool, steps: int) -> list[tuple[str, Path, object, int]]:
    """(name, data folder, TrainConfig, timed batches) per case."""
    from asrflow.params import load_params
    from asrflow.testing.tiny_config import TINY_MODEL
    from asrflow.training.config import load_train_config

    train = train_config(repo_params(), quick=quick, epochs=1000)
    if quick:
        return [("generated, tiny model", generated_data(work, 200), train, 1)]
    preset = load_train_config(load_params(REPO / "presets" / "real-corpus.yaml"))
    preset = replace(train, **{key: getattr(preset, key) for key in (*TINY_MODEL, "subsampling_channels")})
    preset = replace(preset, max_duration_s=PRESET_BATCH_S)
    generated = generated_data(work, 300)
    return [
        ("yesno, params.yaml model", yesno_data(work), train, steps),
        ("generated, params.yaml model", generated, train, steps),
        ("generated, real-corpus preset model", generated, preset, max(2, steps // 2)),
    ]


def measure(name: str, data: Path, config, *, timed: int, threads: int) -> list[dict]:
    """Every precision's step time on the same ``timed`` batches (plus one warm-up); one record each."""
    import torch

    from asrflow.model.conformer_ctc import count_parameters
    from asrflow.training.precision import resolve_precision
    from bench.train_throughput import PlannedBatches, bare_step, build

    torch.set_num_threads(threads)
    features = data_features(data)
    planned = PlannedBatches(data, config, features, seed=0)
    vocab_size = planned.tokenizer.vocab_size
    runs = {p: (resolve_precision(p, "cpu", None), *build(config, features, 0, vocab_size)) for p in PRECISIONS}
    seconds = dict.fromkeys(PRECISIONS, 0.0)
    audio_s = 0.0
    for index in range(timed + 1):
        batches = planned.next_step()
        for precision, (policy, model, optimizer) in runs.items():
            spent = bare_step(model, optimizer, batches, policy)
            seconds[precision] += spent if index else 0.0
        audio_s += sum(float(b["durations"].sum()) for b in batches) if index else 0.0
    fp32_rate = audio_s / seconds["fp32"]
    params = count_parameters(runs["fp32"][1])
    common = {"benchmark": "cpu_precision", "case": name}
    common |= {"params": params, "threads": threads, "timed_batches": timed, "audio_s_timed": rounded(audio_s)}
    return [
        {**common, "precision": precision, "audio_s_per_s": rounded(audio_s / spent)}
        | {"ratio_to_fp32": rounded(ratio(audio_s / spent, fp32_rate))}
        for precision, spent in seconds.items()
    ]


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser) -> None:
        parser.add_argument("--steps", type=int, default=6, help="timed batches per case (default 6)")
        parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, params.yaml's)")

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    from asrflow.training.precision import native_bf16_cpu_flags, resolve_precision

    flags = native_bf16_cpu_flags()
    auto = resolve_precision("auto", "cpu", None, flags)
    out = [emit({"benchmark": "machine", **machine(), "cpu_bf16": list(flags), "auto_picks": auto.name})]
    with workdir(args.workdir) as work:
        for name, data, config, timed in cases(work, args.quick, args.steps):
            out += [emit(record) for record in measure(name, data, config, timed=timed, threads=args.threads)]
    return out


if __name__ == "__main__":
    main()
