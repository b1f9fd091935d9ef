"""Padding of training batches: asrflow's bucketed plan against random batching of the same corpus.

``python -m bench.padding [--quick] [--workdir DIR]``: ``1 - real / padded frames`` over three epochs of
:func:`asrflow.data.batches.plan_epoch`, against Lhotse's shuffled ``SimpleCutSampler``; ``by_num_buckets``.
"""

from __future__ import annotations

from asrflow.testing.corpora import generated_data, yesno_data
from asrflow.testing.repo import repo_params
from bench.common import emit, parse_args, ratio, rounded, workdir

#: Utterances of the generated corpus (shared with bench.train_throughput), per mode.
GENERATED = {"full": 2000, "quick": 200}
EPOCHS = 3
OTHER_NUM_BUCKETS = (5, 20, 30, 50)


def padding_of(batches: list[list[int]]) -> tuple[float, int, float]:
    """Padding ratio of batches given as lists of frame counts, the number of batches, and
    their mean number of real frames."""
    real = sum(sum(batch) for batch in batches)
    padded = sum(len(batch) * max(batch) for batch in batches)
    return 1.0 - real / padded, len(batches), real / len(batches)


def frames_of(cuts) -> dict[str, int]:
    return {cut.id: cut.num_frames for cut in cuts}


def planned(cuts, frames: dict[str, int], *, seed: int, max_duration_s: float, num_buckets: int):
    """Padding of asrflow's plan over ``EPOCHS`` epochs."""
    from asrflow.data.batches import plan_epoch

    batches = [
        [frames[cut_id] for cut_id in batch]
        for epoch in range(EPOCHS)
        for batch in plan_epoch(cuts, epoch, seed=seed, max_duration_s=max_duration_s, num_buckets=num_buckets)
    ]
    return padding_of(batches)


def random_batches(cuts, frames: dict[str, int], seed: int, max_duration_s: float) -> tuple[float, int, float]:
    """Padding of shuffled ``SimpleCutSampler`` batches over ``EPOCHS`` epochs."""
    from lhotse.dataset import SimpleCutSampler

    sampler = SimpleCutSampler(cuts, max_duration=max_duration_s, shuffle=True, seed=seed, drop_last=False)
    batches = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        batches.extend([frames[cut.id] for cut in batch] for batch in sampler)
    return padding_of(batches)


def measure(corpus: str, data, params: dict) -> dict:
    from asrflow.data.manifests import load_cuts
    from asrflow.training.config import load_train_config

    train = load_train_config(params)
    max_duration, num_buckets = train.max_duration_s, train.num_buckets
    seed = int(params.get("seed", 0))
    cuts = load_cuts(data / "fbank", "train").to_eager()
    frames = frames_of(cuts)
    durations = sorted(cut.duration for cut in cuts)
    figure, n_planned, fill_planned = planned(
        cuts, frames, seed=seed, max_duration_s=max_duration, num_buckets=num_buckets
    )
    baseline, n_random, fill_random = random_batches(cuts, frames, seed, max_duration)
    frame_s = cuts[0].frame_shift
    spread = [rounded(durations[0]), rounded(durations[len(durations) // 2]), rounded(durations[-1])]
    record = {"benchmark": "padding", "corpus": corpus, "utterances": len(cuts), "duration_s_min_median_max": spread}
    record |= {"max_duration_s": max_duration, "num_buckets": num_buckets, "epochs": EPOCHS}
    record |= {"padding_ratio": rounded(figure), "baseline_random_padding_ratio": rounded(baseline)}
    record |= {"ratio": rounded(ratio(figure, baseline)), "batches_planned": n_planned, "batches_random": n_random}
    record |= {"mean_batch_audio_s_planned": rounded(fill_planned * frame_s)}
    record |= {"mean_batch_audio_s_random": rounded(fill_random * frame_s)}
    record |= {"goal": "padding_ratio <= 0.05", "meets_goal": figure <= 0.05}
    plan = {"seed": seed, "max_duration_s": max_duration}
    by_buckets = {str(n): rounded(planned(cuts, frames, num_buckets=n, **plan)[0]) for n in OTHER_NUM_BUCKETS}
    return {**record, "by_num_buckets": by_buckets}


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(__doc__.splitlines()[0], argv)
    mode = "quick" if args.quick else "full"
    params = repo_params()
    with workdir(args.workdir) as work:
        return [
            emit({**measure("generated", generated_data(work, GENERATED[mode]), params), "mode": mode}),
            emit({**measure("yesno", yesno_data(work), params), "mode": mode}),
        ]


if __name__ == "__main__":
    main()
