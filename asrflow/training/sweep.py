"""Checkpoints of an experiment that DVC runs in a temporary workspace (``dvc exp run --queue`` or ``--temp``).

DVC runs such an experiment in a fresh copy of the repository under ``.dvc/tmp/exps/`` and deletes the
copy when the experiment ends, finished, failed or killed, so checkpoints kept there could never be
resumed. They go to ``exp/sweeps/<key>/`` of the repository DVC copied instead (``$DVC_ROOT``), and the
copy's ``exp/checkpoints`` (the train stage's persistent output) is a link to it. The key is a digest of
every param that shapes the trained model, so queueing the same params again resumes the unfinished
run; the resume fingerprint still refuses a folder whose data or settings differ.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Under the original repository: one folder of checkpoints per set of params that shape the model.
SWEEP_DIR = Path("exp/sweeps")
#: Sections and keys that do not change the trained model: left out of the key.
_NOT_IN_KEY = ("run", "evaluate")
_NOT_IN_KEY_TRAIN = ("checkpoint",)


def origin_repo(cwd: str | os.PathLike = ".") -> Path | None:
    """The repository DVC copied when this process runs in DVC's temporary workspace, else None.

    DVC sets ``$DVC_ROOT`` for every stage: the repository's root, which is the stage's folder except in a
    queued or ``--temp`` experiment, where it names the repository the experiment was queued from.
    """
    root = os.environ.get("DVC_ROOT")
    if not root or Path(root).resolve() == Path(cwd).resolve():
        return None
    return Path(root).resolve()


def sweep_key(params: Mapping[str, Any]) -> str:
    """The params digest (8 hex characters) over every key but ``run:``, ``evaluate:`` and ``train.checkpoint``."""
    from asrflow.tracking.naming import params_digest

    shaping = {key: value for key, value in params.items() if key not in _NOT_IN_KEY}
    if isinstance(shaping.get("train"), Mapping):
        shaping["train"] = {k: v for k, v in shaping["train"].items() if k not in _NOT_IN_KEY_TRAIN}
    return params_digest(shaping)


@contextlib.contextmanager
def checkpoints_outside_temp_workspace(
    checkpoint_dir: Path, params: Mapping[str, Any], *, main_process: bool = True
) -> Iterator[Path]:
    """Yield the folder training should keep its checkpoints in: ``checkpoint_dir`` itself outside DVC's
    temporary workspace; inside it, ``<origin>/exp/sweeps/<key>/``, with ``checkpoint_dir`` made a link to
    it. The main process holds the folder's lock until the block ends, so two experiments with the same
    key train one after the other (the second finds the first's finished run and trains no further)."""
    origin = origin_repo()
    if origin is None:
        yield checkpoint_dir
        return
    folder = origin / SWEEP_DIR / sweep_key(params)
    if not main_process:
        yield folder
        return
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "wb") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("another experiment trains with the same params in %s: waiting for it", folder)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if checkpoint_dir.is_symlink() or checkpoint_dir.is_file():
            checkpoint_dir.unlink()
        elif checkpoint_dir.is_dir():
            checkpoint_dir.rmdir()  # DVC's copy holds no checkpoints; a non-empty folder is left to fail loudly
        checkpoint_dir.parent.mkdir(parents=True, exist_ok=True)
        checkpoint_dir.symlink_to(folder, target_is_directory=True)
        logger.info("DVC temporary workspace: checkpoints go to %s (kept for a resume)", folder)
        yield folder
