"""Global mean/variance statistics of the fbank features (CMVN): computed over the train
split by the features stage, written as JSON, applied by :class:`lhotse.dataset.GlobalMVN`."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from lhotse import CutSet
from lhotse.dataset import GlobalMVN
from lhotse.features.base import compute_global_stats

from asrflow.data.features.config import FeatureConfig
from asrflow.errors import AsrflowError

#: The statistics' file in a features folder.
CMVN_FILE = "cmvn.json"


def cmvn_stats(mvn: GlobalMVN) -> dict[str, list[float]]:
    """``norm_means`` / ``norm_stds``, each a list of ``num_mel_bins`` floats."""
    return {name: value.tolist() for name, value in mvn.state_dict().items()}


def save_cmvn(mvn: GlobalMVN, path: Path) -> None:
    """Write :func:`cmvn_stats` as JSON."""
    path.write_text(json.dumps(cmvn_stats(mvn), indent=1) + "\n")


def load_cmvn(path: str | Path) -> GlobalMVN:
    """Read statistics written by :func:`save_cmvn` into a ``GlobalMVN`` module."""
    return cmvn_from_dict(json.loads(Path(path).read_text()))


def cmvn_from_dict(stats: dict[str, list[float]]) -> GlobalMVN:
    """Build a ``GlobalMVN`` from the statistics dict kept inside a model bundle."""
    tensors = {name: torch.tensor(value, dtype=torch.float32) for name, value in stats.items()}
    mvn = GlobalMVN(tensors["norm_means"].numel())
    mvn.load_state_dict(tensors)
    return mvn


def train_statistics(cuts: CutSet, config: FeatureConfig) -> GlobalMVN:
    """Per-bin mean and std over the train cuts (stored, or computed for up to 1,000 cuts), in one pass."""
    if config.on_the_fly:
        return GlobalMVN.from_cuts(cuts, max_cuts=1000, extractor=config.extractor())
    features = (cut.features for cut in cuts)
    first = next(features, None)
    if first is None:
        raise AsrflowError("no train cut's audio could be read, so there are no features: check the train audio")
    stats = compute_global_stats(itertools.chain([first], features))
    return cmvn_from_dict({name: value.tolist() for name, value in stats.items()})
