"""params.yaml's ``train.data`` section: how training batches are formed and augmented."""

from __future__ import annotations

from dataclasses import dataclass

from asrflow.errors import AsrflowError
from asrflow.params import check_at_least, check_positive, param_error

SECTION = "train.data"


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The ``train.data`` section (each key is documented in params.yaml): batching by padded seconds of audio
    in length buckets, SpecAugment, speed perturbation, noise, and each corpus' share of an epoch."""

    max_duration_s: float
    num_buckets: int
    pad_frames_to: int
    spec_augment: bool
    num_freq_masks: int
    freq_mask_width: int
    num_time_masks: int
    time_mask_ratio: float
    speed_perturb: bool
    noise_dir: str | None
    #: [low, high] dB.
    noise_snr_db: list[float]
    corpus_weights: dict[str, float]

    def __post_init__(self) -> None:
        check_positive(self, SECTION, "max_duration_s")
        check_at_least(self, SECTION, 1, "num_buckets", "pad_frames_to")
        check_at_least(self, SECTION, 0, "num_freq_masks", "freq_mask_width", "num_time_masks")
        if not 0.0 <= self.time_mask_ratio <= 1.0:
            raise param_error(SECTION, "time_mask_ratio", self.time_mask_ratio, "must be in [0, 1]")
        snr = self.noise_snr_db
        if len(snr) != 2 or snr[0] > snr[1]:
            raise param_error(
                SECTION, "noise_snr_db", snr, "must be two numbers [low, high] with low <= high, e.g. [10, 20]"
            )
        for name, weight in self.corpus_weights.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
                raise AsrflowError(
                    f"params.yaml: {SECTION}.corpus_weights.{name} = {weight!r} must be a number > 0 "
                    "(a corpus' share of an epoch is its weight x its utterances; one left out has weight 1)"
                )
