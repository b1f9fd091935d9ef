"""Where an item's audio path may point: inside the corpus folder, to a file that exists."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from asrflow.data.prepare.rejections import MISSING_AUDIO, PATH_OUTSIDE, ItemRejected


def resolve_inside(root: Path, raw: str) -> Path:
    """Turn an audio path from a transcript file into a path inside ``root``.

    Args:
        root: the corpus folder, already resolved (absolute, no symlinks).
        raw: the path as written in the file: relative to ``root``, or absolute.

    Returns:
        The normalised absolute path (inside ``root``) of an existing file.

    Raises:
        ItemRejected: ``path_outside_corpus`` or ``missing_audio``.
    """
    candidate = Path(raw)
    if not candidate.is_absolute():
        candidate = root / candidate
    lexical = Path(os.path.normpath(candidate))
    if not lexical.is_relative_to(root):
        raise ItemRejected(
            PATH_OUTSIDE,
            f"audio path {raw!r} points outside corpus_dir {root}; "
            "audio must live inside corpus_dir (no '..', no absolute paths elsewhere)",
        )
    real = lexical.resolve() if lexical.is_symlink() else _resolved_folder(str(lexical.parent)) / lexical.name
    if not real.is_relative_to(root):
        raise ItemRejected(
            PATH_OUTSIDE,
            f"audio path {raw!r} is a symlink to {real}, outside corpus_dir {root}; "
            "copy the file into corpus_dir instead of linking it",
        )
    if not real.is_file():
        raise ItemRejected(MISSING_AUDIO, f"audio file {raw!r} not found in {root}; add it or drop its line")
    return lexical


@functools.lru_cache(maxsize=4096)
def _resolved_folder(folder: str) -> Path:
    """A folder's real path (the folders of a corpus are few; their files many)."""
    return Path(folder).resolve()
