"""A compact, id-sorted index of a cut manifest, and the epoch planner that works from it.

Training on a million utterances cannot hold a million Lhotse ``Cut`` objects in the
trainer and in every data worker (about 1.3 KB each, pickled into every spawned worker).
:class:`CutIndex` keeps, per cut, only what planning and lookup need:

* ``ids``: ``(N,)`` numpy bytes (UTF-8), sorted; byte order = code-point order, so this is
  the order of ``sorted(cut ids)``;
* ``durations``: ``(N,)`` float64 seconds;
* ``offsets``: ``(N,)`` int64 byte offsets of each cut's JSON line in ``store``, an
  uncompressed copy of the manifest's lines (in the manifest's order; the index is sorted).

About ``len(id) + 16`` bytes per cut (40 MB per million cuts with 24-character ids). A
worker reads the cuts of a batch from ``store`` by offset (one ``seek`` + ``readline`` each).

:func:`plan_epoch_index` makes an epoch's batches from ``(id, duration)`` only:

1. a full permutation of the id-sorted cuts drawn from ``numpy.random.default_rng([seed,
   epoch])``: independent of the manifest's order on disk (so of ``features.num_jobs``);
2. equal-count duration buckets (edges at the duration quantiles of the whole corpus);
3. in each bucket, cuts in permutation order are packed greedily while ``cuts x longest
   <= max_duration_s`` (the padded duration, Lhotse's ``TimeConstraint``); a cut longer
   than ``max_duration_s`` is a batch of its own;
4. the last, partial batch of each bucket is joined to its neighbours' while the result
   still fits (a small corpus would otherwise be mostly partial batches);
5. the batches of all buckets are put in an order drawn from the same generator.

So every stretch of an epoch holds cuts from the whole corpus (global shuffle), and
padding stays that of ``num_buckets`` buckets. With several weighted corpora
(:class:`CorpusMix`), step 1 first picks the cuts the epoch takes (:func:`mix_positions`):
the same planning then runs over them.

The content digest (:attr:`CutIndex.digest`) hashes every cut's manifest entry, less the
feature storage location (``storage_path``, ``storage_key``: they depend on how many
extraction jobs wrote the features and where the folder is), in id order: the same corpus
and features give the same digest whatever the job layout or manifest order.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
from lhotse.cut import Cut
from lhotse.cut.set import deserialize_cut

from asrflow.errors import AsrflowError
from asrflow.params import env_number

#: Manifest keys left out of the content digest: where the features are stored, not what they are.
STORAGE_KEYS = ("storage_path", "storage_key")
#: Cuts read between two conversions to numpy arrays (and memory checks) while building.
BUILD_CHUNK = 100_000
#: Prefix of the scratch folders that hold index stores, and the lock file their owner holds.
STORE_PREFIX = "asrflow-cut-index-"
STORE_LOCK = ".owner.lock"
#: Node-wide lock file (in the stores' root) held while stores are looked up, built or removed.
REGISTRY_LOCK = "asrflow-cut-index.lock"
#: Version of a shared store's layout: a store of another version is rebuilt.
STORE_FORMAT = 1
#: Hex characters of a manifest digest (MLflow's dataset digest).
MANIFEST_DIGEST_CHARS = 16
#: Building stops with an error when less memory than this is left (MB); the variable sets another floor.
MIN_FREE_ENV = "ASRFLOW_INDEX_MIN_FREE_MB"
DEFAULT_MIN_FREE_MB = 256


def available_memory() -> int | None:
    """Bytes the kernel says can still be allocated (``MemAvailable``), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_memory(manifest: Path, cuts_read: int) -> None:
    """Stop building before the machine runs out of memory, naming the manifest, the floor and what to do."""
    free, floor_mb = available_memory(), env_number(MIN_FREE_ENV, DEFAULT_MIN_FREE_MB)
    if free is not None and free < floor_mb * 2**20:
        raise AsrflowError(
            f"{manifest} is too large for this machine's memory: {cuts_read} cuts indexed and only "
            f"{free // 2**20} MB left, under the {floor_mb:g} MB the index keeps free ({MIN_FREE_ENV}); "
            "train on a machine with more memory or on fewer utterances (prepare.splits, "
            f"prepare.max_duration_s), or set {MIN_FREE_ENV} lower to let the index take more"
        )


_STORAGE_FIELD = re.compile(rb'"storage_(?:path|key)": ?(?:"(?:[^"\\]|\\.)*"|[-+.0-9eE]+|null)')


class _StoreFolder(tempfile.TemporaryDirectory):
    """A temporary folder whose owner holds an exclusive ``flock`` on its :data:`STORE_LOCK` file
    for as long as it lives. The kernel drops the lock when the owner dies however it dies, so
    a lock that can be taken marks a folder nobody owns (whatever PID namespace the owner ran in)."""

    def __init__(self, root: Path):
        super().__init__(prefix=STORE_PREFIX, dir=root)
        # Locked before it gets its name: no other process ever sees the file unlocked.
        handle = tempfile.NamedTemporaryFile(dir=self.name, delete=False)  # noqa: SIM115 (held while the folder lives)
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        os.rename(handle.name, Path(self.name) / STORE_LOCK)
        self._lock = handle

    def cleanup(self) -> None:
        self._lock.close()
        super().cleanup()

    def share(self) -> _SharedHold:
        """The folder became a shared store (renamed): never remove it, and turn the exclusive lock
        into a shared hold (call under the node lock: the conversion is not atomic)."""
        self._finalizer.detach()
        fcntl.flock(self._lock.fileno(), fcntl.LOCK_SH)
        return _SharedHold(self._lock)


def _owned(folder: Path) -> bool:
    """Whether a living process holds ``folder``'s lock (a folder without one is being made)."""
    try:
        handle = (folder / STORE_LOCK).open("rb")
    except FileNotFoundError:
        return True
    with handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False


def _remove_unowned(root: Path, keep: Path | None = None) -> None:
    """Remove the ``asrflow-cut-index-*`` folders under ``root`` that no living process holds.

    A process killed outright (SIGKILL, the OOM killer, a preempted job) never removes what it
    made; the kernel drops its lock, so such folders are found here (see :class:`_StoreFolder`).
    """
    for folder in root.glob(f"{STORE_PREFIX}*"):
        if folder != keep and folder.is_dir() and not _owned(folder):
            shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def _node_lock(root: Path) -> Iterator[None]:
    """Hold the node-wide :data:`REGISTRY_LOCK` under ``root`` (blocks while another process does)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / REGISTRY_LOCK, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        yield


def manifest_key(manifest: Path) -> str:
    """16 hex digits naming a manifest's shared store: its resolved path, size and modification
    time (what a rewrite changes) and :data:`STORE_FORMAT`; reading the file is not needed."""
    stat = manifest.stat()
    text = f"{manifest.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{STORE_FORMAT}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _SharedHold:
    """A shared ``flock`` on a store's :data:`STORE_LOCK`: the store is in use while this lives."""

    def __init__(self, handle):
        self._handle = handle

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __del__(self) -> None:
        self.release()


def _hold_shared(folder: Path) -> _SharedHold:
    handle = (folder / STORE_LOCK).open("rb")
    fcntl.flock(handle.fileno(), fcntl.LOCK_SH)
    return _SharedHold(handle)


def _load_store(folder: Path) -> CutIndex | None:
    """The index saved in a complete shared store folder, or None (incomplete or damaged)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        if meta.get("format") != STORE_FORMAT or (folder / "lines.jsonl").stat().st_size != meta["store_bytes"]:
            return None
        with np.load(folder / "arrays.npz") as arrays:
            ids, durations, offsets = arrays["ids"], arrays["durations"], arrays["offsets"]
    except (OSError, ValueError, KeyError):
        return None
    index = CutIndex(ids, durations, offsets, store=folder / "lines.jsonl", digest=meta["digest"])
    index.manifest_digest = meta["manifest_digest"]
    return index


def _save_store(index: CutIndex, folder: Path, manifest: Path) -> None:
    """The arrays and facts of ``index`` (built into ``folder / 'lines.jsonl'``) next to its lines."""
    with open(folder / "arrays.npz", "wb") as out:
        np.savez(out, ids=index.ids, durations=index.durations, offsets=index.offsets)
    meta = {
        "format": STORE_FORMAT,
        "manifest": str(manifest.resolve()),
        "digest": index.digest,
        "manifest_digest": index.manifest_digest,
        "store_bytes": (folder / "lines.jsonl").stat().st_size,
    }
    (folder / "meta.json").write_text(json.dumps(meta))


#: What this process learnt of manifests while indexing them, by :func:`manifest_key`.
_MANIFEST_FACTS: dict[str, dict] = {}


def combined_digest(digests: Iterable[str]) -> str:
    """One digest for several manifests' digests (order matters)."""
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()[:MANIFEST_DIGEST_CHARS]


def manifest_facts(manifest: str | Path) -> dict:
    """``{"digest", "utterances", "hours"}`` of a cut manifest: the digest is the SHA-256 of its
    *decompressed* content (gzip headers hold a time stamp). Taken from the index this process built
    of it with :func:`shared_index` (unchanged since), else from one read in constant memory."""
    path = Path(manifest)
    try:
        known = _MANIFEST_FACTS.get(manifest_key(path))
    except OSError:
        known = None
    if known and known["digest"]:
        return dict(known)
    whole, utterances, seconds = hashlib.sha256(), 0, 0.0
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as source:
            for line in source:
                whole.update(line)
                if line.strip():
                    utterances, seconds = utterances + 1, seconds + float(orjson.loads(line)["duration"])
    except (OSError, EOFError, ValueError, KeyError, TypeError) as error:
        raise AsrflowError(f"cannot read manifest {path} ({error}); run the stage that writes it again") from None
    digest = whole.hexdigest()[:MANIFEST_DIGEST_CHARS]
    return {"digest": digest, "utterances": utterances, "hours": round(seconds / 3600, 4)}


def _remember(manifest: Path, index: CutIndex) -> CutIndex:
    _MANIFEST_FACTS[manifest_key(manifest)] = {
        "digest": index.manifest_digest,
        "utterances": len(index),
        "hours": round(float(index.durations.sum()) / 3600, 4),
    }
    return index


def shared_index(manifest: str | Path, root: str | Path | None = None) -> CutIndex:
    """The :class:`CutIndex` of ``manifest`` over the node's one shared line store of it.

    The store (an uncompressed copy of the manifest's lines and the index's arrays) is the
    folder ``asrflow-cut-index-<key>`` under ``root`` (default: the system's temporary folder),
    ``<key>`` from :func:`manifest_key`. The first process to ask builds it; every other
    process on the node (the other ranks, later runs on the same manifest) waits for it and
    loads it (no reading of the manifest, no hashing). Each user holds a shared lock on the
    store while its index lives (``index.store_owner``); stores of other manifests (or older
    versions of this one) that nobody holds are removed, so a node keeps one store per
    manifest in use, and one when idle.

    Raises:
        AsrflowError: see :meth:`CutIndex.build`.
    """
    manifest, root = Path(manifest), Path(root or tempfile.gettempdir())
    if not manifest.is_file():
        raise AsrflowError(f"{manifest} not found: run the stage that writes it first")
    final = root / f"{STORE_PREFIX}{manifest_key(manifest)}"
    with _node_lock(root):
        _remove_unowned(root, keep=final)
        index = _load_store(final) if final.is_dir() else None
        if index is not None:
            index.store_owner = _hold_shared(final)
            return _remember(manifest, index)
        if final.is_dir() and _owned(final):  # damaged but in use by someone: build a private one
            private = _StoreFolder(root)
            index = CutIndex.build(manifest, Path(private.name) / "lines.jsonl")
            index.store_owner = private
            return _remember(manifest, index)
        shutil.rmtree(final, ignore_errors=True)
        building = _StoreFolder(root)
        try:
            index = CutIndex.build(manifest, Path(building.name) / "lines.jsonl")
            _save_store(index, Path(building.name), manifest)
            os.rename(building.name, final)
        except BaseException:
            building.cleanup()
            raise
        index.store = final / "lines.jsonl"
        index.store_owner = building.share()
        return _remember(manifest, index)


def _content_digest(line: bytes) -> bytes:
    """SHA-256 of one cut's manifest line without its feature storage location.

    The line is Lhotse's JSON (one writer, one key order), so equal content gives equal
    bytes once ``storage_path`` / ``storage_key`` are blanked (a regex: parsing and
    re-serialising every line costs twice as much).
    """
    return hashlib.sha256(_STORAGE_FIELD.sub(b"", line.rstrip(b"\n"))).digest()


class CutIndex:
    """Id-sorted ``(id, duration, offset)`` arrays of a manifest and the line store they point into.

    Build one with :meth:`build` (or :meth:`from_cuts` for cuts already in memory). It is
    cheap to pickle (three numpy arrays and a path), so DataLoader workers get their own copy.
    """

    def __init__(
        self,
        ids: np.ndarray,
        durations: np.ndarray,
        offsets: np.ndarray,
        *,
        store: Path | None,
        digest: str | None,
        cuts: dict[str, Cut] | None = None,
    ):
        #: Whatever keeps ``store`` alive in this process (e.g. a ``TemporaryDirectory``); not pickled.
        self.store_owner: object | None = None
        self.ids = ids
        self.durations = durations
        self.offsets = offsets
        self.store = store
        self._digest = digest
        self._cuts = cuts  # only for from_cuts (small, in-memory corpora)
        self._handle = None
        self._pid = None
        #: SHA-256 (16 hex digits) of the manifest's decompressed bytes, when built from one.
        self.manifest_digest: str | None = None

    @property
    def digest(self) -> str:
        """16 hex digits of the content digest (see the module docstring); for an in-memory
        index computed on first use, so indexing a ``CutSet`` for planning costs no hashing."""
        if self._digest is None:
            digest = hashlib.sha256()
            for cut_id in self.id_list():
                digest.update(_content_digest(json.dumps(self._cuts[cut_id].to_dict(), ensure_ascii=False).encode()))
            self._digest = digest.hexdigest()[:16]
        return self._digest

    # ------------------------------------------------------------------ building
    @classmethod
    def build(cls, manifest: str | Path, store: str | Path) -> CutIndex:
        """Read ``manifest`` (Lhotse ``jsonl`` or ``jsonl.gz``) once, writing its lines to ``store``.

        The same pass hashes the manifest's decompressed bytes (:attr:`manifest_digest`, what
        the MLflow dataset of the split shows), so no one reads the manifest again for it.
        Memory: the arrays plus 32 bytes per cut while building (the content hashes).

        Raises:
            AsrflowError: the manifest is missing, not JSON lines, or holds an id twice.
        """
        manifest, store = Path(manifest), Path(store)
        if not manifest.is_file():
            raise AsrflowError(f"{manifest} not found: run the stage that writes it first")
        chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        ids: list[bytes] = []
        durations: list[float] = []
        offsets: list[int] = []
        hashes: list[bytes] = []

        def flush() -> None:
            if ids:
                chunks.append(
                    (
                        np.array(ids, dtype=np.bytes_),
                        np.array(durations, dtype=np.float64),
                        np.array(offsets, dtype=np.int64),
                        np.array(hashes, dtype="S32"),
                    )
                )
                ids.clear(), durations.clear(), offsets.clear(), hashes.clear()
            _check_memory(manifest, sum(len(chunk[0]) for chunk in chunks))

        opener = gzip.open if manifest.suffix == ".gz" else open
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_name(store.name + ".tmp")
        position = 0
        whole = hashlib.sha256()
        with opener(manifest, "rb") as source, open(tmp, "wb") as out:
            for number, line in enumerate(source, start=1):
                whole.update(line)
                if not line.strip():
                    continue
                try:
                    entry = orjson.loads(line)
                    cut_id, duration = entry["id"], float(entry["duration"])
                except (ValueError, KeyError, TypeError) as error:
                    tmp.unlink(missing_ok=True)
                    raise AsrflowError(
                        f"{manifest}, line {number}: not a cut ({type(error).__name__}: {error}); "
                        "re-run the stage that wrote it"
                    ) from None
                if not line.endswith(b"\n"):
                    line += b"\n"
                ids.append(cut_id.encode("utf-8"))
                durations.append(duration)
                offsets.append(position)
                hashes.append(_content_digest(line))
                out.write(line)
                position += len(line)
                if len(ids) >= BUILD_CHUNK:
                    try:
                        flush()
                    except AsrflowError:
                        out.close()
                        tmp.unlink(missing_ok=True)
                        raise
        flush()
        os.replace(tmp, store)
        if not chunks:
            index = cls._sorted(
                np.array([], dtype="S1"),
                np.array([]),
                np.array([], dtype=np.int64),
                np.array([], dtype="S32"),
                store=store,
                cuts=None,
                source=str(manifest),
            )
        else:
            index = cls._sorted(
                *(np.concatenate([chunk[k] for chunk in chunks]) for k in range(4)),
                store=store,
                cuts=None,
                source=str(manifest),
            )
        index.manifest_digest = whole.hexdigest()[:MANIFEST_DIGEST_CHARS]
        return index

    @classmethod
    def from_cuts(cls, cuts: Iterable[Cut]) -> CutIndex:
        """An index of cuts held in memory (small corpora and tests): lookups return these objects."""
        held: dict[str, Cut] = {}
        ids, durations = [], []
        for cut in cuts:
            held[cut.id] = cut
            ids.append(cut.id.encode("utf-8"))
            durations.append(float(cut.duration))
        return cls._sorted(
            np.array(ids, dtype=np.bytes_) if ids else np.array([], dtype="S1"),
            np.array(durations, dtype=np.float64),
            np.zeros(len(ids), dtype=np.int64),
            None,
            store=None,
            cuts=held,
            source="cuts",
        )

    @classmethod
    def _sorted(
        cls,
        id_array: np.ndarray,
        durations: np.ndarray,
        offsets: np.ndarray,
        hashes: np.ndarray | None,
        *,
        store: Path | None,
        cuts: dict[str, Cut] | None,
        source: str,
    ) -> CutIndex:
        order = np.argsort(id_array, kind="stable")
        id_array = id_array[order]
        if len(id_array) > 1:
            same = np.flatnonzero(id_array[1:] == id_array[:-1])
            if len(same):
                raise AsrflowError(
                    f"{source}: cut id {id_array[same[0]].decode()!r} occurs more than once; "
                    "re-run the prepare stage (it keeps the first valid copy of an id)"
                )
        digest = None if hashes is None else hashlib.sha256(np.ascontiguousarray(hashes[order]).tobytes())
        return cls(
            id_array,
            durations[order],
            offsets[order],
            store=store,
            digest=None if digest is None else digest.hexdigest()[:16],
            cuts=cuts,
        )

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self.ids)

    def id_list(self, positions: Sequence[int] | np.ndarray | None = None) -> list[str]:
        """Cut ids (``str``) at ``positions`` of the sorted index (all, in id order, when None)."""
        chosen = self.ids if positions is None else self.ids[np.asarray(positions, dtype=np.int64)]
        return [raw.decode("utf-8") for raw in chosen.tolist()]

    def positions(self, cut_ids: Sequence[str]) -> np.ndarray:
        """``(len(cut_ids),)`` int64 positions of ``cut_ids`` in the sorted index.

        Raises:
            KeyError: an id the index does not hold.
        """
        wanted = np.array([cut_id.encode("utf-8") for cut_id in cut_ids], dtype=self.ids.dtype)
        found = np.searchsorted(self.ids, wanted)
        found = np.minimum(found, max(len(self.ids) - 1, 0))
        bad = np.flatnonzero(self.ids[found] != wanted) if len(self.ids) else np.arange(len(wanted))
        if len(bad):
            raise KeyError(cut_ids[int(bad[0])])
        return found.astype(np.int64)

    def cuts(self, cut_ids: Sequence[str]) -> list[Cut]:
        """The Lhotse cuts of ``cut_ids``, in that order (read from the store by offset)."""
        if self._cuts is not None:
            return [self._cuts[cut_id] for cut_id in cut_ids]
        return [self._read(int(offset)) for offset in self.offsets[self.positions(cut_ids)]]

    def iter_cuts(self) -> Iterator[Cut]:
        """Every cut, in id order (for one pass over the corpus: CTC filtering, statistics)."""
        if self._cuts is not None:
            yield from (self._cuts[cut_id] for cut_id in self.id_list())
            return
        for offset in self.offsets.tolist():
            yield self._read(offset)

    def iter_entries(self) -> Iterator[tuple[int, dict]]:
        """``(position, manifest entry as a dict)`` for every cut, reading the store front to
        back (in the store's order, not id order): one sequential pass, no ``Cut`` objects."""
        if self._cuts is not None:
            for position, cut_id in enumerate(self.id_list()):
                yield position, self._cuts[cut_id].to_dict()
            return
        by_offset = np.argsort(self.offsets, kind="stable")
        with open(self.store, "rb") as handle:
            for position in by_offset.tolist():
                handle.seek(int(self.offsets[position]))
                yield position, orjson.loads(handle.readline())

    def select(self, positions: np.ndarray) -> CutIndex:
        """The sub-index of the cuts at ``positions`` (e.g. those CTC can align); same store."""
        positions = np.sort(np.asarray(positions, dtype=np.int64))
        digest = hashlib.sha256(self.digest.encode())
        digest.update(positions.tobytes())
        cuts = None
        if self._cuts is not None:
            cuts = {cut_id: self._cuts[cut_id] for cut_id in self.id_list(positions)}
        return CutIndex(
            self.ids[positions],
            self.durations[positions],
            self.offsets[positions],
            store=self.store,
            digest=digest.hexdigest()[:16],
            cuts=cuts,
        )

    def cached_array(self, name: str, compute: Callable[[], np.ndarray]) -> np.ndarray:
        """``compute()``, kept as ``<name>.npy`` in the index's shared store (see :func:`shared_index`)
        and read from there by later callers on the same store; computed each time elsewhere.
        ``name`` must say everything the array depends on besides the manifest."""
        folder = Path(self.store).parent if self.store is not None else None
        if folder is None or not (folder / "meta.json").is_file():
            return compute()
        path = folder / f"{hashlib.sha256(name.encode()).hexdigest()[:16]}.npy"
        try:
            return np.load(path)
        except (OSError, ValueError):
            pass
        array = compute()
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as out:
            np.save(out, array)
        os.replace(tmp, path)
        return array

    def nbytes(self) -> int:
        """Bytes held by the arrays (what a worker's copy costs, beyond a few objects)."""
        return int(self.ids.nbytes + self.durations.nbytes + self.offsets.nbytes)

    def _read(self, offset: int) -> Cut:
        if self._handle is None or self._pid != os.getpid():
            self._handle = open(self.store, "rb")  # noqa: SIM115 (kept open for the process' lifetime)
            self._pid = os.getpid()
        self._handle.seek(offset)
        return deserialize_cut(orjson.loads(self._handle.readline()))

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handle"] = None  # a worker opens its own
        state["store_owner"] = None  # the training process keeps the store alive
        state["_pid"] = None
        return state


# ---------------------------------------------------------------------- planning


def epoch_permutation(num_cuts: int, seed: int, epoch: int) -> np.ndarray:
    """``(num_cuts,)`` int64: a full permutation of positions in id order, drawn from ``(seed, epoch)``."""
    return np.random.default_rng([seed, epoch]).permutation(num_cuts)


def bucket_of(durations: np.ndarray, num_buckets: int) -> np.ndarray:
    """``(N,)`` bucket number of each duration: edges at the quantiles, so buckets hold equal counts."""
    if num_buckets <= 1 or len(durations) == 0:
        return np.zeros(len(durations), dtype=np.int64)
    edges = np.quantile(durations, np.linspace(0.0, 1.0, num_buckets + 1)[1:-1])
    return np.searchsorted(edges, durations, side="right").astype(np.int64)


def plan_positions(
    durations: np.ndarray, epoch: int, *, seed: int, max_duration_s: float, num_buckets: int
) -> list[np.ndarray]:
    """The batches of ``epoch`` as arrays of positions into the id-sorted index.

    Args:
        durations: ``(N,)`` seconds, in id order.
        epoch, seed: what the permutation is drawn from.
        max_duration_s: a batch's cuts x its longest cut stays at or below this (seconds).
        num_buckets: duration buckets (capped at ``N // 2``, at least 1).
    Returns:
        Batches (int64 arrays), in the epoch's order; every position appears exactly once.
    """
    count = len(durations)
    if count == 0:
        return []
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(count)
    buckets = bucket_of(durations, min(num_buckets, max(1, count // 2)))
    order = order[np.argsort(buckets[order], kind="stable")]  # bucket by bucket, permuted inside
    bucket_sorted = buckets[order]
    seconds = durations[order].tolist()
    edges = [0, *(np.flatnonzero(np.diff(bucket_sorted)) + 1).tolist(), count]
    starts = []
    for first, end in zip(edges[:-1], edges[1:], strict=True):  # one bucket at a time
        starts.append(first)
        size, longest = 0, 0.0
        for i in range(first, end):
            duration = seconds[i]
            if duration > longest:
                longest = duration
            size += 1
            if size > 1 and size * longest > max_duration_s:  # this cut opens the next batch
                starts.append(i)
                size, longest = 1, duration
    batches = np.split(order, starts[1:])
    batches = _merge_bucket_tails(batches, bucket_sorted[starts].tolist(), durations, max_duration_s)
    return [batches[i] for i in rng.permutation(len(batches))]


def _merge_bucket_tails(
    batches: list[np.ndarray], bucket_ids: list[int], durations: np.ndarray, max_duration_s: float
) -> list[np.ndarray]:
    """Join the last (partial) batches of neighbouring buckets while they fit in ``max_duration_s``.

    Each bucket ends in one partial batch; on a small corpus they would be most batches.
    ``batches`` are bucket by bucket, ``bucket_ids`` the bucket of each.
    """
    last = {bucket: i for i, bucket in enumerate(bucket_ids)}  # the last batch of each bucket
    tails = [i for i in sorted(last.values())]
    merged: list[np.ndarray] = []
    current = None
    for i in tails:
        joined = batches[i] if current is None else np.concatenate([current, batches[i]])
        if current is not None and len(joined) * float(durations[joined].max()) > max_duration_s:
            merged.append(current)
            joined = batches[i]
        current = joined
    if current is not None:
        merged.append(current)
    tail_set = set(tails)
    return [batch for i, batch in enumerate(batches) if i not in tail_set] + merged


class EpochPlan:
    """An epoch's batches, compactly: ``positions`` ``(N,)`` int64, every cut's position in the
    id-sorted ``index`` batch after batch, and ``bounds`` ``(B + 1,)`` int64, batch ``b`` being
    ``positions[bounds[b]:bounds[b + 1]]``. About 8 bytes a cut, whatever the ids.

    Reads like the list of batches it stands for: ``len(plan)``, ``plan[b]`` (the cut ids of
    batch ``b``, a list of ``str``; a slice gives a list of them), iteration, ``==``.
    """

    def __init__(self, index: CutIndex, positions: np.ndarray, bounds: np.ndarray):
        self.index = index
        self.positions = positions
        self.bounds = bounds
        self._digest: str | None = None

    @classmethod
    def from_batches(cls, index: CutIndex, batches: Sequence[np.ndarray]) -> EpochPlan:
        lengths = np.array([len(batch) for batch in batches], dtype=np.int64)
        positions = np.concatenate(batches).astype(np.int64) if batches else np.zeros(0, dtype=np.int64)
        return cls(index, positions, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def batch_positions(self, first: int, end: int | None = None) -> np.ndarray:
        """Positions (into the index) of the cuts of batches ``first`` .. ``end - 1`` (default: ``first`` only)."""
        end = first + 1 if end is None else end
        return self.positions[self.bounds[first] : self.bounds[end]]

    def __getitem__(self, batch: int | slice) -> list[str] | list[list[str]]:
        if isinstance(batch, slice):
            return [self[b] for b in range(*batch.indices(len(self)))]
        if not -len(self) <= batch < len(self):
            raise IndexError(batch)
        return self.index.id_list(self.batch_positions(batch % len(self)))

    def __iter__(self) -> Iterator[list[str]]:
        return (self[b] for b in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EpochPlan) and len(self) == len(other) and self.digest == other.digest

    __hash__ = None  # type: ignore[assignment]

    @property
    def digest(self) -> str:
        """16 hex digits of the batches as cut ids (so equal for the same cuts indexed from any manifest
        order); computed once, on first use: a checkpoint's cost does not grow with the corpus."""
        if self._digest is None:
            digest = hashlib.sha256(np.ascontiguousarray(self.bounds).tobytes())
            ids = self.index.ids
            for first in range(0, len(self.positions), BUILD_CHUNK):
                digest.update(b"\0".join(ids[self.positions[first : first + BUILD_CHUNK]].tolist()) + b"\0")
            self._digest = digest.hexdigest()[:16]
        return self._digest


@dataclass(frozen=True, kw_only=True)
class CorpusMix:
    """How an epoch mixes the corpora of a train split (see :func:`mix_positions`).

    Attributes:
        corpus_of: ``(N,)`` int64, the corpus of each cut of the id-sorted index (an index into ``weights``).
        weights: each corpus' weight, > 0: an epoch takes ``round(weight x its cuts)`` of its cuts.
        names: the corpora's names, for messages.
    """

    corpus_of: np.ndarray
    weights: tuple[float, ...]
    names: tuple[str, ...]

    def counts(self) -> list[int]:
        """Cuts of each corpus in the index."""
        return np.bincount(self.corpus_of, minlength=len(self.weights)).tolist()

    def epoch_counts(self) -> list[int]:
        """Cuts of each corpus an epoch takes: ``round(weight x count)``, at least 1 of a corpus that has any."""
        return [max(1 if count else 0, round(w * count)) for w, count in zip(self.weights, self.counts(), strict=True)]


def mix_positions(mix: CorpusMix, seed: int, epoch: int) -> np.ndarray:
    """The cuts an epoch takes, as sorted positions into the index (a position repeats for a weight above 1).

    Corpus ``i`` with ``N_i`` cuts and weight ``w_i`` gives ``k_i = round(w_i x N_i)`` cuts: every
    cut ``floor(k_i / N_i)`` times, and ``k_i mod N_i`` more drawn without replacement, from
    ``numpy.random.default_rng([seed, epoch, i])``. Deterministic for ``(seed, epoch)``, and the
    draw of the extra cuts changes with the epoch, so over epochs each cut is seen in proportion.
    """
    chosen = []
    for number, take in enumerate(mix.epoch_counts()):
        members = np.flatnonzero(mix.corpus_of == number)
        if not len(members):
            continue
        whole, extra = divmod(take, len(members))
        chosen.extend([members] * whole)
        if extra:
            rng = np.random.default_rng([seed, epoch, number])
            chosen.append(np.sort(rng.choice(members, size=extra, replace=False)))
    return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, dtype=np.int64)


def plan_epoch_index(
    index: CutIndex, epoch: int, *, seed: int, max_duration_s: float, num_buckets: int, mix: CorpusMix | None = None
) -> EpochPlan:
    """:func:`plan_positions` over ``index`` (or over the cuts ``mix`` takes this epoch), as an :class:`EpochPlan`."""
    if mix is None:
        batches = plan_positions(
            index.durations, epoch, seed=seed, max_duration_s=max_duration_s, num_buckets=num_buckets
        )
        return EpochPlan.from_batches(index, batches)
    taken = mix_positions(mix, seed, epoch)
    batches = plan_positions(
        index.durations[taken], epoch, seed=seed, max_duration_s=max_duration_s, num_buckets=num_buckets
    )
    return EpochPlan.from_batches(index, [taken[batch] for batch in batches])


def data_digest(index: CutIndex, *paths: str | Path) -> str:
    """The resume fingerprint's data digest: the index's content digest (cuts without their
    feature storage location) and the bytes of ``paths`` (tokenizer model, ``cmvn.json``).

    Unlike hashing the cuts manifest's bytes, it does not change with ``features.num_jobs``
    (which only moves where the features are stored). 16 hex digits.
    """
    digest = hashlib.sha256(index.digest.encode())
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]
