"""The node's one shared line store per manifest: :func:`shared_index` builds a manifest's
:class:`~asrflow.data.loading.cut_index.CutIndex` once per node and lets every process on it
(the other ranks, later runs) load it; and what a manifest holds (:func:`manifest_facts`)
without reading it again.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import orjson

from asrflow.data.loading.cut_index import MANIFEST_DIGEST_CHARS, CutIndex
from asrflow.errors import AsrflowError

#: Prefix of the scratch folders that hold index stores, and the lock file their owner holds.
STORE_PREFIX = "asrflow-cut-index-"
STORE_LOCK = ".owner.lock"
#: Node-wide lock file (in the stores' root) held while stores are looked up, built or removed.
REGISTRY_LOCK = "asrflow-cut-index.lock"
#: Version of a shared store's layout: a store of another version is rebuilt.
STORE_FORMAT = 1


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
