"""Scale: a million training utterances, metadata only (no audio).

``python -m bench.scale [--quick] [--workdir DIR] [--cuts N]``: a train manifest of N synthetic cuts. Record
``scale``: the index's build time and size, one epoch's plan per million cuts against Lhotse's
``DynamicBucketingSampler`` (over fewer eager cuts, extrapolated), a spawned worker's RSS growth per million
cuts against a dict of eager cuts, the trainer's RSS, and the time to the first batch at 10/50/90 % of an epoch.
"""

from __future__ import annotations

import gzip
import json
import multiprocessing
import pickle
import statistics
import time
from pathlib import Path

from asrflow.testing.corpora import cut_entry
from bench.common import emit, parse_args, ratio, rounded, workdir

#: Cuts in the manifest, and eager Lhotse cuts for the baselines, per mode.
CUTS, LHOTSE_CUTS = {"full": 1_000_000, "quick": 20_000}, {"full": 60_000, "quick": 5_000}
MAX_DURATION_S, NUM_BUCKETS, SEED = 120.0, 30, 42


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


def main(argv: list[str] | None = None) -> list[dict]:
    def configure(parser):
        parser.add_argument("--cuts", type=int, default=None, help="cuts in the manifest (default: by mode)")

    args = parse_args(__doc__.splitlines()[0], argv, configure)
    from lhotse import CutSet

    from asrflow.data.batches import TrainingBatches, plan_epoch, steps_in_plan
    from asrflow.data.index import CutIndex

    mode = "quick" if args.quick else "full"
    count = args.cuts or CUTS[mode]
    rss_start = peak_rss_mb()
    with workdir(args.workdir) as work:
        manifest = work / f"scale-{count}.jsonl.gz"
        if not manifest.is_file():
            start = time.perf_counter()
            write_manifest(manifest, count)
            generate_s = time.perf_counter() - start
        else:
            generate_s = 0.0
        start = time.perf_counter()
        index = CutIndex.build(manifest, work / f"scale-{count}.store.jsonl")
        build_s = time.perf_counter() - start

        plan_times = []
        for epoch in range(3):
            start = time.perf_counter()
            plan = plan_epoch(index, epoch, seed=SEED, max_duration_s=MAX_DURATION_S, num_buckets=NUM_BUCKETS)
            plan_times.append(time.perf_counter() - start)
        plan_s = statistics.median(plan_times)
        per_million = 1_000_000 / count

        # Resume: time to the first batch at 10 %, 50 % and 90 % of an epoch (fresh plan cache).
        steps = steps_in_plan(plan, 1, 1)
        resume = {}
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

        sample = plan[:200]
        small = CutIndex.build(manifest, work / "one.store.jsonl").select([0])
        worker_empty = worker_peak_mb(small, [])
        worker_index = worker_peak_mb(index, sample)

        # Baselines: Lhotse's sampler and a dict of eager cuts, over LHOTSE_CUTS cuts.
        lhotse_count = min(LHOTSE_CUTS[mode], count)
        eager = CutSet.from_cuts(
            cut for _, cut in zip(range(lhotse_count), CutSet.from_jsonl_lazy(manifest), strict=False)
        ).to_eager()
        lhotse_s = lhotse_plan_s(eager)
        eager_dict = {cut.id: cut for cut in eager}
        dict_ids = list(eager_dict)
        worker_dict = worker_peak_mb(eager_dict, [dict_ids[i : i + 10] for i in range(0, 2000, 10)])

        plan_figure, plan_baseline = plan_s * per_million, lhotse_s * 1_000_000 / lhotse_count
        worker_figure = (worker_index - worker_empty) * per_million
        worker_baseline = (worker_dict - worker_empty) * 1_000_000 / lhotse_count
        record = {"benchmark": "scale", "mode": mode, "cuts": count, "generate_s": generate_s, "index_build_s": build_s}
        record |= {"index_bytes": index.nbytes(), "plan_s": plan_s, "plan_s_per_million": plan_figure}
        record |= {"baseline": f"lhotse DynamicBucketingSampler over {lhotse_count} eager cuts, per million"}
        record |= {"baseline_plan_s_per_million": plan_baseline, "ratio": ratio(plan_figure, plan_baseline)}
        record |= {
            "plan_goal_s_per_million": 5.0,
            "worker_rss_empty_mb": worker_empty,
            "worker_rss_index_mb": worker_index,
        }
        record |= {"worker_rss_growth_mb_per_million": worker_figure, "worker_goal_mb_per_million": 200}
        record |= {"worker_baseline_eager_dict_growth_mb_per_million": worker_baseline}
        record |= {"worker_ratio": ratio(worker_figure, worker_baseline), "trainer_rss_start_mb": rss_start}
        record |= {"trainer_rss_mb": trainer_rss, "resume_s": {key: rounded(value) for key, value in resume.items()}}
        record |= {"resume_90_vs_10": ratio(resume["90%"], resume["10%"]), "batches_per_epoch": len(plan)}
        record = {key: rounded(value) if isinstance(value, float) else value for key, value in record.items()}
        return [emit(record)]


if __name__ == "__main__":
    main()
