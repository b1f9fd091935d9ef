"""Batch plans: padding on real corpora, and a million training utterances, metadata only (no audio).

``python -m bench.scale [--quick] [--workdir DIR] [--cuts N] [--padding]``. Record ``padding`` per corpus
(generated, yesno): ``1 - real / padded frames`` over three epochs of :func:`asrflow.data.loading.planner.plan_epoch`
against Lhotse's shuffled ``SimpleCutSampler``, and ``by_num_buckets``. Record ``scale`` (not with ``--padding``),
over a train manifest of N synthetic cuts: the index's build time and size, one epoch's plan per million cuts
against Lhotse's ``DynamicBucketingSampler`` (over fewer eager cuts, extrapolated), a spawned worker's RSS growth
per million cuts against a dict of eager cuts, the trainer's RSS, the time to the first batch at 10/50/90 %.
"""

from __future__ import annotations

import gzip
import json
import multiprocessing
import pickle
import statistics
import time
from pathlib import Path

from bench.common import emit, parse_args, ratio, workdir
from tests.support.corpora import cut_entry, generated_data, yesno_data
from tests.support.repo import repo_params

#: Cuts in the manifest, and eager Lhotse cuts for the baselines, per mode.
CUTS, LHOTSE_CUTS = {"full": 1_000_000, "quick": 20_000}, {"full": 60_000, "quick": 5_000}
MAX_DURATION_S, NUM_BUCKETS, SEED = 120.0, 30, 42
#: Utterances of the generated corpus of ``padding`` (as bench.train_throughput's), per mode.
GENERATED = {"full": 2000, "quick": 200}
PADDING_EPOCHS = 3
OTHER_NUM_BUCKETS = (5, 20, 30, 50)


def padding_of(batches) -> dict:
    """Padding ratio of batches given as lists of frame counts, their number and mean real frames."""
    real, padded = sum(sum(b) for b in batches), sum(len(b) * max(b) for b in batches)
    return {"padding": 1.0 - real / padded, "batches": len(batches), "mean_frames": real / len(batches)}


def padding(corpus: str, data: Path, params: dict) -> dict:
    """The ``padding`` record of the train cuts of ``data`` at params.yaml's plan settings."""
    from lhotse.dataset import SimpleCutSampler

    from asrflow.data.loading.planner import plan_epoch
    from asrflow.data.manifests import load_cuts
    from asrflow.training.config import load_train_config

    train, seed = load_train_config(params), int(params.get("seed", 0))
    max_duration, num_buckets = train.data.max_duration_s, train.data.num_buckets
    cuts = load_cuts(data / "fbank", "train").to_eager()
    frames = {cut.id: cut.num_frames for cut in cuts}

    def planned(buckets: int) -> dict:
        shape = {"seed": seed, "max_duration_s": max_duration, "num_buckets": buckets}
        plans = [plan_epoch(cuts, epoch, **shape) for epoch in range(PADDING_EPOCHS)]
        return padding_of([[frames[i] for i in batch] for plan in plans for batch in plan])

    sampler = SimpleCutSampler(cuts, max_duration=max_duration, shuffle=True, seed=seed, drop_last=False)
    randomly = []
    for epoch in range(PADDING_EPOCHS):
        sampler.set_epoch(epoch)
        randomly += [[frames[cut.id] for cut in batch] for batch in sampler]
    ours, theirs, durations = planned(num_buckets), padding_of(randomly), sorted(cut.duration for cut in cuts)
    frame_s = cuts[0].frame_shift
    record = {"benchmark": "padding", "corpus": corpus, "utterances": len(cuts)}
    record["duration_s_min_median_max"] = [durations[0], durations[len(durations) // 2], durations[-1]]
    record |= {"max_duration_s": max_duration, "num_buckets": num_buckets, "epochs": PADDING_EPOCHS}
    record |= {"padding_ratio": ours["padding"], "baseline_random_padding_ratio": theirs["padding"]}
    record |= {"ratio": ratio(ours["padding"], theirs["padding"]), "batches_planned": ours["batches"]}
    record |= {"batches_random": theirs["batches"], "mean_batch_audio_s_planned": ours["mean_frames"] * frame_s}
    record |= {"mean_batch_audio_s_random": theirs["mean_frames"] * frame_s, "goal": "padding_ratio <= 0.05"}
    record |= {"meets_goal": ours["padding"] <= 0.05}
    return record | {"by_num_buckets": {str(n): planned(n)["padding"] for n in OTHER_NUM_BUCKETS}}


def write_manifest(path: Path, count: int, seed: int = 0) -> None:
    """A features-stage-like train manifest of ``count`` cuts, sorted by id, gzip level 1."""
    import numpy as np

    rng = np.random.default_rng(seed)
    durations = np.round(rng.uniform(1.0, 20.0, count), 2).tolist()
    rows = []
    for i in range(count):
        speaker, chapter = i % 2311, (i // 2311) % 97
        rows.append((f"{speaker:04d}-{chapter:06d}-{i:07d}", durations[i], i))
    rows.sort()
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as out:
        for cut_id, duration, i in rows:
            text, where = f"WORD{i % 97} WORD{i % 89} WORD{i % 83}", {"storage_key": str(i * 5000)}
            where |= {"storage_path": "data/fbank/train_feats.lca", "source": f"corpus/{cut_id}.flac"}
            entry = cut_entry(cut_id, duration, text=text, speaker=cut_id[:4], **where)
            out.write(json.dumps(entry) + "\n")


def peak_rss_mb() -> float:
    """Peak resident memory of this process image (MB): ``VmHWM`` (``ru_maxrss`` would carry a
    spawned child's parent's peak over ``exec``)."""
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def _worker(payload: bytes, batches: list[list[str]], queue) -> None:
    """In a spawned process: unpickle what a data worker gets, build batches, report peak RSS."""
    held = pickle.loads(payload)
    for batch in batches:
        cuts = held.cuts(batch) if hasattr(held, "cuts") else [held[cut_id] for cut_id in batch]
        assert len(cuts) == len(batch)
    queue.put(peak_rss_mb())


def worker_peak_mb(held, batches: list[list[str]]) -> float:
    """Peak RSS (MB) of a spawned process that receives ``held`` pickled and builds ``batches``."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_worker, args=(pickle.dumps(held), batches, queue))
    process.start()
    peak = queue.get(timeout=600)
    process.join()
    return peak


def lhotse_plan_s(cuts) -> float:
    """Seconds for one epoch of Lhotse's ``DynamicBucketingSampler`` over ``cuts`` (eager)."""
    from lhotse.dataset import DynamicBucketingSampler

    shape = {"max_duration": MAX_DURATION_S, "num_buckets": NUM_BUCKETS, "world_size": 1, "rank": 0}
    sampler = DynamicBucketingSampler(cuts, shuffle=True, drop_last=False, seed=SEED, **shape)
    sampler.set_epoch(0)
    start = time.perf_counter()
    sum(len(batch) for batch in sampler)
    return time.perf_counter() - start


def measure(work: Path, count: int, mode: str) -> dict:
    """The ``scale`` record over a manifest of ``count`` synthetic cuts (written once into ``work``)."""
    from lhotse import CutSet

    from asrflow.data.loading.cut_index import CutIndex
    from asrflow.data.loading.planner import TrainingBatches, plan_epoch, steps_in_plan

    rss_start, manifest = peak_rss_mb(), work / f"scale-{count}.jsonl.gz"
    start = time.perf_counter()
    if not manifest.is_file():
        write_manifest(manifest, count)
    generate_s, start = time.perf_counter() - start, time.perf_counter()
    index = CutIndex.build(manifest, work / f"scale-{count}.store.jsonl")
    build_s, plan_times = time.perf_counter() - start, []
    for epoch in range(3):
        start = time.perf_counter()
        plan = plan_epoch(index, epoch, seed=SEED, max_duration_s=MAX_DURATION_S, num_buckets=NUM_BUCKETS)
        plan_times.append(time.perf_counter() - start)
    plan_s, per_million = statistics.median(plan_times), 1_000_000 / count

    # Resume: time to the first batch at 10 %, 50 % and 90 % of an epoch (fresh plan cache).
    steps, resume = steps_in_plan(plan, 1, 1), {}
    shape = {"max_duration_s": MAX_DURATION_S, "num_buckets": NUM_BUCKETS, "accum_grad": 1, "world_size": 1}
    for _ in range(2):  # each position twice, in turn; the faster run counts
        for share in (0.1, 0.5, 0.9):
            where = {"rank": 0, "start_epoch": 0, "start_step": int(share * steps), "num_epochs": 1}
            batches = TrainingBatches(index, seed=SEED, **shape, **where)
            start = time.perf_counter()
            next(iter(batches))
            key = f"{int(share * 100)}%"
            resume[key] = min(resume.get(key, float("inf")), time.perf_counter() - start)
    trainer_rss = peak_rss_mb()
    worker_empty = worker_peak_mb(CutIndex.build(manifest, work / "one.store.jsonl").select([0]), [])
    worker_index = worker_peak_mb(index, plan[:200])

    # Baselines: Lhotse's sampler and a dict of eager cuts, over LHOTSE_CUTS cuts.
    lhotse_count = min(LHOTSE_CUTS[mode], count)
    lazy = CutSet.from_jsonl_lazy(manifest)
    eager = CutSet.from_cuts(cut for _, cut in zip(range(lhotse_count), lazy, strict=False)).to_eager()
    lhotse_s, eager_dict = lhotse_plan_s(eager), {cut.id: cut for cut in eager}
    ids = list(eager_dict)
    worker_dict = worker_peak_mb(eager_dict, [ids[i : i + 10] for i in range(0, 2000, 10)])
    plan_figure, plan_baseline = plan_s * per_million, lhotse_s * 1_000_000 / lhotse_count
    worker_figure = (worker_index - worker_empty) * per_million
    worker_baseline = (worker_dict - worker_empty) * 1_000_000 / lhotse_count
    record = {"benchmark": "scale", "mode": mode, "cuts": count, "generate_s": generate_s, "index_build_s": build_s}
    record |= {"index_bytes": index.nbytes(), "plan_s": plan_s, "plan_s_per_million": plan_figure}
    record |= {"baseline": f"lhotse DynamicBucketingSampler over {lhotse_count} eager cuts, per million"}
    record |= {"baseline_plan_s_per_million": plan_baseline, "ratio": ratio(plan_figure, plan_baseline)}
    record |= {"plan_goal_s_per_million": 5.0, "worker_rss_empty_mb": worker_empty, "worker_rss_index_mb": worker_index}
    record |= {"worker_rss_growth_mb_per_million": worker_figure, "worker_goal_mb_per_million": 200}
    record |= {"worker_baseline_eager_dict_growth_mb_per_million": worker_baseline}
    record |= {"worker_ratio": ratio(worker_figure, worker_baseline), "trainer_rss_start_mb": rss_start}
    record |= {
        "trainer_rss_mb": trainer_rss,
        "resume_s": resume,
        "resume_90_vs_10": ratio(resume["90%"], resume["10%"]),
    }
    return record | {"batches_per_epoch": len(plan)}


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser):
        parser.add_argument("--cuts", type=int, default=None, help="cuts in the manifest (default: by mode)")
        parser.add_argument("--padding", action="store_true", help="only the padding records")

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    mode, params = "quick" if args.quick else "full", repo_params()
    with workdir(args.workdir) as work:  # scale first: its RSS figures are this process's peaks
        out = [] if args.padding else [emit(measure(work, args.cuts or CUTS[mode], mode))]
        corpora = {"generated": generated_data(work, GENERATED[mode]), "yesno": yesno_data(work)}
        return out + [emit({**padding(name, data, params), "mode": mode}) for name, data in corpora.items()]


if __name__ == "__main__":
    main()
