"""Saving and restoring training checkpoints, and nothing else.

Files are ``<dir>/step-00000050.pt``; ``best.pt`` is a hard link to the checkpoint with
the lowest dev loss. Each is written to a temporary file, fsynced and renamed, so a
crash leaves either the old set or the new one. Loading uses ``weights_only=True``; a
newest checkpoint that is truncated or corrupt is skipped with a warning.

Each checkpoint carries a SHA-256 digest of its own content (every tensor's bytes, dtype
and shape, and every other value), checked on loading: torch's zip reader does not verify
tensor data, so without it a flipped bit in a weight would load silently.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path

import torch

from asrflow.files import fsync_dir

logger = logging.getLogger(__name__)

FORMAT_VERSION = 3
BEST = "best.pt"
_STEP_FILE = re.compile(r"^step-(\d{8})\.pt$")


def checkpoint_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}.pt"


def step_of(path: Path) -> int:
    """The step number in a checkpoint's file name."""
    return int(_STEP_FILE.match(Path(path).name).group(1))


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Step checkpoints in ``directory``, newest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [path for path in directory.iterdir() if _STEP_FILE.match(path.name)]
    return sorted(found, key=step_of, reverse=True)


def save_checkpoint(
    state: dict, directory: str | Path, step: int, *, keep_last: int, is_best: bool, protect: int | None = None
) -> Path:
    """Write ``state`` as step ``step`` atomically; keep the newest ``keep_last``, the best and step ``protect``.

    ``protect`` is the step of the rollback target (the newest checkpoint taken outside a
    streak of non-finite steps), which pruning must not delete.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, step)
    tmp = final.with_name(f".{final.name}.tmp")
    try:
        with open(tmp, "wb") as handle:
            content = {**state, "format": FORMAT_VERSION, "step": step}
            torch.save({**content, "digest": content_digest(content)}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed save (unpicklable state, full disk) leaves nothing behind
        raise
    if is_best:
        link = directory / f".{BEST}.tmp"
        link.unlink(missing_ok=True)
        os.link(final, link)
        os.replace(link, directory / BEST)
    fsync_dir(directory)
    for old in list_checkpoints(directory)[max(keep_last, 1) :]:
        if step_of(old) != protect:
            old.unlink()
    return final


def load_checkpoint(path: str | Path) -> dict:
    """Load one checkpoint safely (no code runs) onto the CPU."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path} is not an asrflow checkpoint of format {FORMAT_VERSION}")
    stored = state.pop("digest", None)
    if stored != content_digest(state):
        raise ValueError(f"{path}: its content does not match the digest stored with it (corrupt data)")
    return state


def content_digest(value) -> str:
    """SHA-256 hex digest of a checkpoint state: nested dicts, lists, tuples, tensors and scalars.

    Tensors count by dtype, shape and raw bytes (not by storage layout), so the digest of a
    state is the same before saving and after loading it.
    """
    digest = hashlib.sha256()
    _update_digest(digest, value)
    return digest.hexdigest()


def _update_digest(digest, value) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"tensor:{tensor.dtype}:{tuple(tensor.shape)}:".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, dict):
        digest.update(f"dict:{len(value)}:".encode())
        for key, item in value.items():
            _update_digest(digest, key)
            _update_digest(digest, item)
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__}:{len(value)}:".encode())
        for item in value:
            _update_digest(digest, item)
    else:
        digest.update(f"{type(value).__name__}:{value!r};".encode())


def load_latest(directory: str | Path) -> tuple[dict, Path] | None:
    """The newest readable checkpoint; unreadable newer ones are skipped with a warning."""
    for path in list_checkpoints(directory):
        try:
            return load_checkpoint(path), path
        except Exception as error:  # a truncated zip, a bad pickle, a wrong format
            logger.warning("checkpoint %s is unreadable (%s); falling back to the previous one", path, error)
    return None


def average_model_states(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Element-wise mean of the ``model`` weights of ``paths`` (integer buffers from the first)."""
    states = [load_checkpoint(path)["model"] for path in paths]
    averaged = {}
    for name, first in states[0].items():
        if first.is_floating_point():
            averaged[name] = sum(state[name].double() for state in states).div(len(states)).to(first.dtype)
        else:
            averaged[name] = first.clone()
    return averaged


def remove_checkpoints(directory: str | Path) -> None:
    """Delete every checkpoint of a finished run (before a fresh one starts)."""
    directory = Path(directory)
    for path in [*list_checkpoints(directory), directory / BEST]:
        path.unlink(missing_ok=True)
