"""The ``features:`` section of params.yaml (:class:`FeatureConfig`), and the check that a
features folder was computed with the settings a model is trained or evaluated with."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lhotse import Fbank, FbankConfig

from asrflow.errors import AsrflowError
from asrflow.params import check_at_least, check_positive

#: The FeatureConfig a features folder was computed with (JSON), written beside its cuts.
CONFIG_FILE = "config.json"
#: FeatureConfig fields that shape the features a model sees (the others only say how they were computed).
SHAPING_FIELDS = ("sampling_rate", "num_mel_bins", "frame_shift_s", "frame_length_s")
#: Fewest mel bins the fbank extractor accepts (it asserts more than 3).
MIN_MEL_BINS = 4


@dataclass(frozen=True, kw_only=True)
class FeatureConfig:
    """The ``features:`` section of params.yaml (each key is documented there, the only place its default
    lives)."""

    sampling_rate: int
    num_mel_bins: int
    frame_shift_s: float
    frame_length_s: float
    num_jobs: int
    on_the_fly: bool

    def __post_init__(self) -> None:
        check_positive(self, "features", "sampling_rate", "frame_shift_s", "frame_length_s")
        check_at_least(self, "features", MIN_MEL_BINS, "num_mel_bins")
        check_at_least(self, "features", 0, "num_jobs")

    def extractor(self) -> Fbank:
        """The Lhotse fbank extractor these settings describe."""
        return Fbank(
            FbankConfig(
                sampling_rate=self.sampling_rate,
                num_mel_bins=self.num_mel_bins,
                frame_shift=self.frame_shift_s,
                frame_length=self.frame_length_s,
            )
        )


def check_same_features(config: FeatureConfig, features_dir: str | Path) -> None:
    """Refuse to train with ``config`` on features computed with other settings.

    The model's input size and frame rate come from ``config`` (params.yaml's ``features``
    section); features computed at another rate or bin count would fail deep inside the
    model, or worse, train on the wrong frame rate. A folder without :data:`CONFIG_FILE`
    (written by older versions) is not checked.

    Raises:
        AsrflowError: naming each differing key, its two values and what to do.
    """
    path = Path(features_dir) / CONFIG_FILE
    if not path.is_file():
        return
    computed = json.loads(path.read_text())
    differing = [
        f"features.{key} = {getattr(config, key)!r} but {computed[key]!r} there"
        for key in SHAPING_FIELDS
        if key in computed and computed[key] != getattr(config, key)
    ]
    if differing:
        raise AsrflowError(
            f"the features in {Path(features_dir)} were computed with other settings than params.yaml's: "
            f"{'; '.join(differing)}. Run the features stage again (dvc repro, or snakemake), or give "
            "the params those features were computed with"
        )
