"""The compact cut index and the global, order-independent epoch planner (issue 13, items 1 and 5).

Corpora are generated metadata-only manifests (no audio): ids in the LibriSpeech style
(speaker first), durations of 1-15 s.
"""

from __future__ import annotations

import gzip
import json
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from lhotse import CutSet
from lhotse.testing.dummies import dummy_cut

from asrflow.data.loading.cut_index import CutIndex
from asrflow.data.loading.index_store import STORE_PREFIX, manifest_facts, shared_index
from asrflow.data.loading.planner import TrainingBatches, plan_digest, plan_epoch, plan_positions
from asrflow.errors import AsrflowError
from tests.support.corpora import cut_entry


def _entries(count: int, seed: int = 0, *, storage: str = "fbank/feats.lca") -> list[dict]:
    """Manifest entries of ``count`` cuts with features, in id order."""
    rng = np.random.default_rng(seed)
    durations = np.round(rng.uniform(1.0, 15.0, count), 2)
    entries = []
    for i in range(count):
        cut_id = f"{i % 251:04d}-{i // 251:03d}-{i:06d}"
        entries.append(
            cut_entry(
                cut_id,
                float(durations[i]),
                text=f"word{i % 7} word{i % 11}",
                storage_path=storage,
                storage_key=str(i * 977),
                source=f"a/{cut_id}.wav",
            )
        )
    entries.sort(key=lambda entry: entry["id"])
    return entries


def _write(path, entries) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as out:
        for entry in entries:
            out.write(json.dumps(entry) + "\n")


@pytest.fixture(scope="module")
def big_index(tmp_path_factory):
    """60,000 cuts through the real path: a jsonl.gz manifest indexed into a line store."""
    folder = tmp_path_factory.mktemp("index")
    _write(folder / "cuts.jsonl.gz", _entries(60_000))
    return CutIndex.build(folder / "cuts.jsonl.gz", folder / "store.jsonl")


@pytest.mark.slow
def test_every_stretch_of_an_epoch_sees_the_whole_corpus(big_index):
    """Item 1: the median sorted-id index of the first and of the last tenth of an epoch's
    batches are both within 10 % of the middle (a buffer-limited shuffle gives ~20 % and ~70 %)."""
    count = len(big_index)
    for epoch in (0, 1):
        batches = plan_positions(big_index.durations, epoch, seed=42, max_duration_s=120.0, num_buckets=30)
        tenth = len(batches) // 10
        first, last = np.concatenate(batches[:tenth]), np.concatenate(batches[-tenth:])
        for part in (first, last):
            assert abs(np.median(part) - count / 2) < 0.1 * count
        assert sorted(np.concatenate(batches).tolist()) == list(range(count))  # a full permutation
    assert plan_epoch(big_index, 0, seed=42, max_duration_s=120.0, num_buckets=30) != plan_epoch(
        big_index, 1, seed=42, max_duration_s=120.0, num_buckets=30
    )


def test_plan_keeps_padding_low_and_batches_within_max_duration(big_index):
    batches = plan_positions(big_index.durations, 0, seed=42, max_duration_s=120.0, num_buckets=30)
    durations = big_index.durations
    real = sum(float(durations[b].sum()) for b in batches)
    padded = sum(len(b) * float(durations[b].max()) for b in batches)
    assert 1 - real / padded <= 0.05
    assert all(len(b) * durations[b].max() <= 120.0 or len(b) == 1 for b in batches)


def test_padded_frames_count_against_max_duration(big_index):
    """With the frame axis padded to 64 frames (0.64 s), a batch of short cuts holds no more padded frames than
    ``max_duration_s`` allows; unpadded plans are what they were."""
    durations = big_index.durations
    padded_s = np.ceil(np.rint(durations / 0.01) / 64) * 0.64
    sizes = {"seed": 42, "max_duration_s": 120.0, "num_buckets": 30}
    uncounted = plan_positions(durations, 0, **sizes)
    assert max(len(b) * padded_s[b].max() for b in uncounted) > 125.0  # the padding the plan did not count
    counted = plan_positions(durations, 0, **sizes, pad_frames_to=64, frame_shift_s=0.01)
    assert all(len(b) * padded_s[b].max() <= 120.0 + 1e-6 or len(b) == 1 for b in counted)
    assert sorted(np.concatenate(counted).tolist()) == list(range(len(durations)))
    unpadded = plan_positions(durations, 0, **sizes, pad_frames_to=1)
    assert all(np.array_equal(a, b) for a, b in zip(unpadded, uncounted, strict=True))


def test_plan_does_not_depend_on_manifest_order_or_storage(tmp_path):
    """Item 2: the same cuts listed in another order (another job layout), with features
    stored elsewhere, give the same plan and the same content digest."""
    entries = _entries(3_000, seed=1)
    _write(tmp_path / "sorted.jsonl.gz", entries)
    shuffled = [dict(entry) for entry in entries]
    np.random.default_rng(5).shuffle(shuffled)
    for n, entry in enumerate(shuffled):
        entry["features"] = {**entry["features"], "storage_path": f"other/feats-{n % 2}", "storage_key": str(n)}
    _write(tmp_path / "shuffled.jsonl.gz", shuffled)
    a = CutIndex.build(tmp_path / "sorted.jsonl.gz", tmp_path / "a.jsonl")
    b = CutIndex.build(tmp_path / "shuffled.jsonl.gz", tmp_path / "b.jsonl")
    assert a.digest == b.digest
    assert plan_digest(plan_epoch(a, 3, seed=7, max_duration_s=60.0, num_buckets=10)) == plan_digest(
        plan_epoch(b, 3, seed=7, max_duration_s=60.0, num_buckets=10)
    )
    # A changed transcript (content) changes the digest.
    shuffled[0]["supervisions"][0]["text"] = "changed"
    _write(tmp_path / "changed.jsonl.gz", shuffled)
    assert CutIndex.build(tmp_path / "changed.jsonl.gz", tmp_path / "c.jsonl").digest != a.digest


def test_in_memory_cutset_plans_like_its_index(tmp_path):
    cuts = CutSet.from_cuts(dummy_cut(i, duration=1.0 + (i * 37 % 90) / 10) for i in range(400))
    reversed_cuts = CutSet.from_cuts(reversed(list(cuts)))
    _write(tmp_path / "cuts.jsonl.gz", [cut.to_dict() for cut in cuts])
    stored = CutIndex.build(tmp_path / "cuts.jsonl.gz", tmp_path / "store.jsonl")
    plans = [
        plan_epoch(source, 2, seed=42, max_duration_s=30.0, num_buckets=8) for source in (cuts, reversed_cuts, stored)
    ]
    assert plans[0] == plans[1] == plans[2]


def test_lookup_reads_the_right_cut_and_pickles_small(big_index):
    ids = big_index.id_list([0, 12_345, len(big_index) - 1])
    cuts = big_index.cuts(ids[::-1])
    assert [cut.id for cut in cuts] == ids[::-1]
    assert cuts[0].supervisions[0].text and cuts[0].num_frames > 0
    with pytest.raises(KeyError):
        big_index.positions(["no-such-cut"])
    copy = pickle.loads(pickle.dumps(big_index))
    assert [cut.id for cut in copy.cuts(ids)] == ids
    # ~40 bytes a cut: a worker's copy of a million-cut index stays far below 200 MB.
    assert len(pickle.dumps(big_index)) < 60 * len(big_index)


def test_training_batches_take_an_index(big_index):
    batches = TrainingBatches(
        big_index,
        seed=42,
        max_duration_s=120.0,
        num_buckets=30,
        accum_grad=2,
        world_size=2,
        rank=1,
        start_epoch=0,
        start_step=0,
        num_epochs=1,
    )
    items = list(batches)
    plan = batches.plan(0)
    assert items[0].cut_ids == tuple(plan[1]) and items[1].cut_ids == tuple(plan[3])
    assert items[0].step_cut_ids == tuple(cut_id for batch in plan[:4] for cut_id in batch)


def test_duplicate_ids_and_broken_lines_are_clear_errors(tmp_path):
    entries = _entries(4)
    _write(tmp_path / "dup.jsonl.gz", entries + entries[:1])
    with pytest.raises(AsrflowError, match="occurs more than once"):
        CutIndex.build(tmp_path / "dup.jsonl.gz", tmp_path / "store.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"id": "a", "duration": 1.0}\nnot json\n')
    with pytest.raises(AsrflowError, match="line 2: not a cut"):
        CutIndex.build(tmp_path / "bad.jsonl", tmp_path / "store.jsonl")
    with pytest.raises(AsrflowError, match="not found"):
        CutIndex.build(tmp_path / "missing.jsonl.gz", tmp_path / "store.jsonl")


def test_a_manifest_too_large_for_memory_stops_by_name_and_writes_nothing(tmp_path, monkeypatch):
    import asrflow.data.loading.cut_index as index_module

    _write(tmp_path / "train_cuts.jsonl.gz", _entries(50))
    monkeypatch.setattr(index_module, "BUILD_CHUNK", 20)
    monkeypatch.setattr(index_module, "available_memory", lambda: 100 * 2**20)  # a machine with 100 MB left
    with pytest.raises(
        AsrflowError,
        match=r"train_cuts.jsonl.gz is too large for this machine's memory: 20 cuts "
        r"indexed and only 100 MB left, under the 256 MB the index keeps free \(ASRFLOW_INDEX_MIN_FREE_MB\); "
        r".*set ASRFLOW_INDEX_MIN_FREE_MB lower",
    ):
        CutIndex.build(tmp_path / "train_cuts.jsonl.gz", tmp_path / "store" / "train.jsonl")
    assert list((tmp_path / "store").iterdir()) == []
    monkeypatch.setenv("ASRFLOW_INDEX_MIN_FREE_MB", "64")  # the floor lowered: the same machine builds it
    assert len(CutIndex.build(tmp_path / "train_cuts.jsonl.gz", tmp_path / "store" / "train.jsonl").ids) == 50
    monkeypatch.setenv("ASRFLOW_INDEX_MIN_FREE_MB", "lots")
    with pytest.raises(AsrflowError, match=r"ASRFLOW_INDEX_MIN_FREE_MB='lots': give a number >= 0"):
        CutIndex.build(tmp_path / "train_cuts.jsonl.gz", tmp_path / "store2" / "train.jsonl")


_HOLD_STORE = (
    "import os, signal, sys\n"
    "from asrflow.data.loading.index_store import shared_index\n"
    "index = shared_index(sys.argv[1], sys.argv[2])\n"
    "print(index.store, flush=True)\n"
    "{end}\n"
)


def _hold_store(manifest: Path, root: Path, end: str) -> subprocess.Popen:
    """A process that opens ``manifest``'s shared store under ``root``, prints its line store and runs ``end``."""
    code = _HOLD_STORE.format(end=end)
    return subprocess.Popen(
        [sys.executable, "-c", code, str(manifest), str(root)], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True
    )


def _stores(root: Path) -> list[Path]:
    return sorted(root.glob(f"{STORE_PREFIX}*"))


@pytest.mark.slow
def test_ranks_share_one_store_and_runs_reuse_it(tmp_path, monkeypatch):
    """Two processes (two ranks of a node) starting together get one store; a later run on the
    unchanged manifest loads it without reading the manifest; a changed manifest gets a new store
    and the old one, held by nobody, is removed: one store per node, not one per rank and run."""
    manifest, root = tmp_path / "train_cuts.jsonl.gz", tmp_path / "tmp"
    _write(manifest, _entries(3000))
    ranks = [_hold_store(manifest, root, "sys.stdin.read()") for _ in range(2)]
    stores = [rank.stdout.readline().strip() for rank in ranks]
    assert stores[0] == stores[1] and len(_stores(root)) == 1
    for rank in ranks:
        rank.communicate("")
    built = CutIndex.build(manifest, tmp_path / "reference.jsonl")

    def no_build(*_args, **_kwargs):
        raise AssertionError("the store was rebuilt")

    with monkeypatch.context() as patch:
        patch.setattr(CutIndex, "build", no_build)
        reused = shared_index(manifest, root)
    assert str(reused.store) == stores[0]
    assert np.array_equal(reused.ids, built.ids) and np.array_equal(reused.offsets, built.offsets)
    assert reused.digest == built.digest and reused.manifest_digest == built.manifest_digest
    assert [cut.id for cut in reused.cuts(reused.id_list([5, 0]))] == reused.id_list([5, 0])

    _write(manifest, _entries(2000, seed=1))  # the features stage ran again
    changed = shared_index(manifest, root)
    assert len(_stores(root)) == 2  # the old store is still held (by `reused`)
    reused.store_owner.release()  # its hold goes: the next start removes the old store
    again = shared_index(manifest, root)
    assert _stores(root) == [Path(again.store).parent] and again.store == changed.store


def test_a_killed_builders_folder_is_removed_and_a_killed_users_store_reused(tmp_path):
    """SIGKILL skips every clean-up, but the kernel drops the dead process' lock: a store it had
    finished is reused by the next start, a half-built folder of it is removed."""
    manifest, root = tmp_path / "train_cuts.jsonl.gz", tmp_path / "tmp"
    _write(manifest, _entries(500))
    killed = _hold_store(manifest, root, "os.kill(os.getpid(), signal.SIGKILL)")
    store = killed.stdout.readline().strip()
    assert killed.wait() == -signal.SIGKILL
    half_built = root / f"{STORE_PREFIX}half-built"
    half_built.mkdir()
    (half_built / ".owner.lock").touch()  # a builder killed mid-way: nobody holds its lock
    index = shared_index(manifest, root)
    assert str(index.store) == store and not half_built.exists()


def test_the_mlflow_dataset_takes_the_indexed_manifests_digest_without_reading_it(tmp_path, monkeypatch):
    """The train manifest is read once at start-up: its decompressed-bytes digest and profile come
    from the index's pass over it, and equal what reading it gives."""
    import asrflow.data.loading.index_store as index_module

    manifest, root = tmp_path / "train_cuts.jsonl.gz", tmp_path / "tmp"
    _write(manifest, _entries(400))
    expected = manifest_facts(manifest)  # read: no index yet
    index = shared_index(manifest, root)

    def unread(*_args, **_kwargs):
        raise AssertionError("the manifest was read again")

    monkeypatch.setattr(index_module.gzip, "open", unread)
    assert manifest_facts(manifest) == expected
    assert index.manifest_digest == expected["digest"] and expected["utterances"] == 400


def test_plans_are_compact_and_their_digest_is_computed_once(big_index, monkeypatch):
    """A plan holds int64 positions and batch bounds (no Python strings: ~8 bytes a cut), reads
    as the lists of ids it stands for, and checkpoints reuse its digest instead of re-encoding it."""
    import hashlib

    batches = TrainingBatches(
        big_index,
        seed=42,
        max_duration_s=120.0,
        num_buckets=30,
        accum_grad=1,
        world_size=1,
        rank=0,
        start_epoch=0,
        start_step=0,
        num_epochs=1,
    )
    plan = batches.plan(0)
    assert plan.positions.dtype == np.int64 and plan.positions.nbytes + plan.bounds.nbytes < 9 * len(big_index)
    as_lists = [
        big_index.id_list(batch)
        for batch in plan_positions(big_index.durations, 0, seed=42, max_duration_s=120.0, num_buckets=30)
    ]
    assert list(plan) == as_lists and plan[3] == as_lists[3] and plan[2:4] == as_lists[2:4]
    first = plan_digest(plan)
    calls = []
    real = hashlib.sha256
    monkeypatch.setattr(hashlib, "sha256", lambda *args: calls.append(1) or real(*args))
    assert all(plan_digest(batches.plan(0)) == first for _ in range(5)) and calls == []
