"""A compact, id-sorted index of a cut manifest (:class:`CutIndex`), and the digests taken from it.

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
The node shares one store per manifest (:mod:`asrflow.data.loading.index_store`); the epoch
planner works from the index's ids and durations (:mod:`asrflow.data.loading.planner`).

The content digest (:attr:`CutIndex.digest`) hashes every cut's manifest entry, less the
feature storage location (``storage_path``, ``storage_key``: they depend on how many
extraction jobs wrote the features and where the folder is), in id order: the same corpus
and features give the same digest whatever the job layout or manifest order.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import orjson
from lhotse import CutSet
from lhotse.cut import Cut
from lhotse.cut.set import deserialize_cut

from asrflow.errors import AsrflowError
from asrflow.params import env_number

#: Manifest keys left out of the content digest: where the features are stored, not what they are.
STORAGE_KEYS = ("storage_path", "storage_key")
#: Cuts read between two conversions to numpy arrays (and memory checks) while building.
BUILD_CHUNK = 100_000
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


def _content_digest(line: bytes) -> bytes:
    """SHA-256 of one cut's manifest line without its feature storage location.

    The line is Lhotse's JSON (one writer, one key order), so equal content gives equal
    bytes once ``storage_path`` / ``storage_key`` are blanked (a regex: parsing and
    re-serialising every line costs twice as much).
    """
    return hashlib.sha256(_STORAGE_FIELD.sub(b"", line.rstrip(b"\n"))).digest()


class _Columns:
    """The index's columns while it is built: lists for the current :data:`BUILD_CHUNK` cuts, numpy
    arrays for the chunks before them; the memory left is checked after each chunk."""

    def __init__(self, manifest: Path) -> None:
        self.manifest = manifest
        self.chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.ids: list[bytes] = []
        self.durations: list[float] = []
        self.offsets: list[int] = []
        self.hashes: list[bytes] = []

    def add(self, cut_id: bytes, duration: float, offset: int, content_hash: bytes) -> None:
        self.ids.append(cut_id)
        self.durations.append(duration)
        self.offsets.append(offset)
        self.hashes.append(content_hash)
        if len(self.ids) >= BUILD_CHUNK:
            self.flush()

    def flush(self) -> None:
        """The current lists into a chunk of arrays, then the memory check.

        Raises:
            AsrflowError: less memory left than the index keeps free (:func:`_check_memory`).
        """
        if self.ids:
            self.chunks.append(
                (
                    np.array(self.ids, dtype=np.bytes_),
                    np.array(self.durations, dtype=np.float64),
                    np.array(self.offsets, dtype=np.int64),
                    np.array(self.hashes, dtype="S32"),
                )
            )
            self.ids.clear(), self.durations.clear(), self.offsets.clear(), self.hashes.clear()
        _check_memory(self.manifest, sum(len(chunk[0]) for chunk in self.chunks))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(ids, durations, offsets, content hashes)`` in manifest order (call :meth:`flush` first)."""
        if not self.chunks:
            return (
                np.array([], dtype="S1"),
                np.array([]),
                np.array([], dtype=np.int64),
                np.array([], dtype="S32"),
            )
        return tuple(np.concatenate([chunk[k] for chunk in self.chunks]) for k in range(4))


def _copy_lines(manifest: Path, copy: Path, columns: _Columns) -> str:
    """Copy ``manifest``'s (decompressed) cut lines to ``copy``, each ending in a newline, adding
    each cut to ``columns``; returns the digest of the manifest's decompressed bytes.

    Raises:
        AsrflowError: a line that is not a cut, or too little memory left.
    """
    opener = gzip.open if manifest.suffix == ".gz" else open
    position = 0
    whole = hashlib.sha256()
    with opener(manifest, "rb") as source, open(copy, "wb") as out:
        for number, line in enumerate(source, start=1):
            whole.update(line)
            if not line.strip():
                continue
            try:
                entry = orjson.loads(line)
                cut_id, duration = entry["id"], float(entry["duration"])
            except (ValueError, KeyError, TypeError) as error:
                raise AsrflowError(
                    f"{manifest}, line {number}: not a cut ({type(error).__name__}: {error}); "
                    "re-run the stage that wrote it"
                ) from None
            if not line.endswith(b"\n"):
                line += b"\n"
            out.write(line)
            columns.add(cut_id.encode("utf-8"), duration, position, _content_digest(line))
            position += len(line)
    columns.flush()
    return whole.hexdigest()[:MANIFEST_DIGEST_CHARS]


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
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_name(store.name + ".tmp")
        columns = _Columns(manifest)
        try:
            manifest_digest = _copy_lines(manifest, tmp, columns)
        except AsrflowError:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, store)
        index = cls._sorted(*columns.arrays(), store=store, cuts=None, source=str(manifest))
        index.manifest_digest = manifest_digest
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
        """``compute()``, kept as ``<name>.npy`` in the index's shared store (see
        :func:`~asrflow.data.loading.index_store.shared_index`) and read from there by later callers
        on the same store; computed each time elsewhere. ``name`` must say everything the array
        depends on besides the manifest."""
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


def as_index(cuts: CutSet | CutIndex) -> CutIndex:
    """``cuts`` as a :class:`CutIndex` (a ``CutSet`` is indexed in memory)."""
    return cuts if isinstance(cuts, CutIndex) else CutIndex.from_cuts(cuts)
