"""The self-contained model file: weights, model shape, tokenizer, feature settings, CMVN.

``exp/model.pt`` works outside the repository: ``load_bundle`` needs nothing else. It is
saved with plain tensors and dicts and loaded with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from lhotse.dataset import GlobalMVN

from asrflow.data.features.cmvn import cmvn_from_dict
from asrflow.data.features.config import FeatureConfig
from asrflow.errors import AsrflowError, first_line
from asrflow.files import atomic_path
from asrflow.model.conformer_ctc import ConformerCtc, build_from_record
from asrflow.tokenizer import Tokenizer

BUNDLE_FORMAT = 1
#: How the features of bundles written before these ``features`` keys existed were computed (neither shapes
#: the features the model takes).
FEATURES_ADDED_LATER = {"num_jobs": 0, "on_the_fly": False}


@dataclass(kw_only=True)
class Bundle:
    """A loaded model file, ready to run (``model`` in eval mode, on the device it was loaded to)."""

    model: ConformerCtc
    tokenizer: Tokenizer
    features: FeatureConfig
    mvn: GlobalMVN
    run_id: str | None
    info: dict


def save_bundle(
    path: str | Path,
    *,
    model_state: dict[str, torch.Tensor],
    model_shape: dict,
    tokenizer: Tokenizer,
    features: FeatureConfig,
    cmvn: dict[str, list[float]],
    run_id: str | None,
    info: dict | None = None,
) -> None:
    """Write the bundle atomically; ``model_shape`` is the model's
    :func:`~asrflow.model.conformer_ctc.shape_record`."""
    payload = {
        "format": BUNDLE_FORMAT,
        "model": model_state,
        "model_config": model_shape,
        "tokenizer": torch.frombuffer(bytearray(tokenizer.serialized()), dtype=torch.uint8),
        "features": asdict(features),
        "cmvn": cmvn,
        "run_id": run_id or "",
        "info": info or {},
    }
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)


def read_bundle(path: str | Path) -> dict:
    """The saved dict of a bundle (tensors and plain values; no model is built, nothing drawn from the RNG).

    Raises :class:`AsrflowError` when ``path`` is missing, unreadable or not an asrflow bundle."""
    path = Path(path)
    if not path.is_file():
        raise AsrflowError(f"model file {path} not found: train a model first (snakemake --cores all)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise AsrflowError(f"model file {path} is unreadable ({first_line(error)}); retrain or copy it again") from None
    if not isinstance(payload, dict) or payload.get("format") != BUNDLE_FORMAT:
        raise AsrflowError(f"{path} is not an asrflow model file (format {BUNDLE_FORMAT})")
    return payload


def load_bundle(path: str | Path, device: torch.device | None = None) -> Bundle:
    """Load a bundle written by :func:`save_bundle` (no code runs while loading), its model on ``device``
    (default: the CPU)."""
    payload = read_bundle(path)
    model = build_from_record(payload["model_config"])  # older bundles lack later keys: see ADDED_LATER
    model.load_state_dict(payload["model"])
    model.eval()
    if device is not None:
        model.to(device)
    return Bundle(
        model=model,
        tokenizer=Tokenizer(payload["tokenizer"].numpy().tobytes()),
        features=FeatureConfig(**(FEATURES_ADDED_LATER | payload["features"])),
        mvn=cmvn_from_dict(payload["cmvn"]),
        run_id=payload["run_id"] or None,
        info=payload["info"],
    )
