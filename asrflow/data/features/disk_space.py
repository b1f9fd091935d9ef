"""Whether the features will fit: one pass over each split's manifest (:func:`scan_split`), the
size the features will take (:func:`estimate_bytes`), and the check against the free space
(:func:`check_disk_space`), all before the features stage writes anything."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from asrflow.data.features.config import FeatureConfig
from asrflow.data.manifests import cuts_path, load_cuts
from asrflow.errors import AsrflowError
from asrflow.params import env_number

logger = logging.getLogger(__name__)

#: Bytes per stored feature value with ``LilcomChunkyWriter`` (log-mel fbank; measured: bench/RESULTS.md#features-disk).
LILCOM_BYTES_PER_VALUE = 1.0
#: Bytes per cut of the written cut manifests (gzipped JSON lines), an upper bound.
MANIFEST_BYTES_PER_CUT = 400
#: Environment variable: the factor the estimated size is multiplied by before it is compared with the free space.
DISK_MARGIN_ENV = "ASRFLOW_FEATURES_DISK_MARGIN"
DEFAULT_DISK_MARGIN = 1.2


@dataclass(frozen=True)
class SplitScan:
    """What one pass over a split's manifest found: its cuts, seconds of audio, multi-channel cuts."""

    count: int
    audio_s: float
    multichannel: int


def scan_split(manifests_dir: str | Path, split: str) -> SplitScan:
    """Count the cuts of a split and their audio, checking that they come in id order (as prepare writes them).

    Raises:
        AsrflowError: the manifest is missing, or two cuts are out of order (a manifest not written by prepare).
    """
    count, audio_s, multichannel, previous = 0, 0.0, 0, None
    for cut in load_cuts(manifests_dir, split):
        if previous is not None and cut.id <= previous:
            raise AsrflowError(
                f"{cuts_path(manifests_dir, split)}: cut {cut.id!r} comes after {previous!r}; the features "
                "stage needs the cuts sorted by id, each id once (as the prepare stage writes them): re-run prepare"
            )
        previous = cut.id
        count += 1
        audio_s += cut.duration
        multichannel += (cut.num_channels or 1) > 1
    if count == 0:
        logger.warning("split %s is empty", split)
    return SplitScan(count=count, audio_s=audio_s, multichannel=multichannel)


def estimate_bytes(scans: Iterable[SplitScan], config: FeatureConfig) -> int:
    """Bytes the features folder of these splits will take: lilcom-stored frames plus the cut manifests."""
    total = 0.0
    for scan in scans:
        frames = scan.audio_s / config.frame_shift_s + scan.count  # (one more frame per cut at most)
        total += frames * config.num_mel_bins * LILCOM_BYTES_PER_VALUE + scan.count * MANIFEST_BYTES_PER_CUT
    return int(total)


def disk_margin() -> float:
    """The factor on the size estimate (environment variable :data:`DISK_MARGIN_ENV`, default 1.2).

    Raises:
        AsrflowError: the variable is set but is not a number >= 0.
    """
    return env_number(DISK_MARGIN_ENV, DEFAULT_DISK_MARGIN)


def check_disk_space(
    output_dir: str | Path, needed_bytes: int, *, free_bytes: int | None = None, margin: float = DEFAULT_DISK_MARGIN
) -> None:
    """Refuse to start when ``needed_bytes`` x ``margin`` exceed the free space where ``output_dir`` goes.

    ``free_bytes`` stands for the free space of that disk (default: ``shutil.disk_usage`` of the
    nearest existing folder on the way to ``output_dir``).

    Raises:
        AsrflowError: naming the space needed and available, and what to do.
    """
    output_dir = Path(output_dir).absolute()
    if free_bytes is None:
        existing = next(folder for folder in (output_dir, *output_dir.parents) if folder.exists())
        free_bytes = shutil.disk_usage(existing).free
    wanted = needed_bytes * margin
    if wanted > free_bytes:
        raise AsrflowError(
            f"the features need about {_gib(needed_bytes)} (x {margin:g} margin: {_gib(wanted)}) in {output_dir}, "
            f"but {_gib(free_bytes)} are free there: free some space, point --out at a larger disk, "
            f"or lower the margin with {DISK_MARGIN_ENV} (nothing was written)"
        )


def _gib(size: float) -> str:
    return f"{size / 2**30:.2f} GiB"
