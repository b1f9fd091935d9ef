"""Fine-tuning: the weights a fresh run starts from when ``train.finetune.init_from`` names a trained model.

``init_from`` is a model bundle (the ``exp/model.pt`` another run wrote) or an MLflow model URI
(``models:/<name>/<version>``, ``models:/<model id>``, ``runs:/<run id>/model``) downloaded from the
run's tracking store. The encoder (the subsampling front end and the Conformer layers) is loaded; the
CTC head too when the tokenizer is the same piece for piece (compared by content, whatever its file is
called), else the head drawn for the new vocabulary is kept. A resumed run loads its checkpoint instead:
the init model only decides its fingerprint.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from asrflow.data.features.config import FeatureConfig
from asrflow.errors import AsrflowError, first_line
from asrflow.model.conformer_ctc import HEAD_PREFIX, ModelConfig, config_from_record, shape_record
from asrflow.params import check_at_least, check_positive, param_error
from asrflow.serving.bundle import read_bundle
from asrflow.tokenizer import Tokenizer
from asrflow.tracking.store import check_tracking_uri, create_whole_sqlite_store

logger = logging.getLogger(__name__)

SECTION = "train.finetune"
KEY = f"{SECTION}.init_from"
#: MLflow run tag naming the model a fine-tuning run started from (``asrflow.init_digest``: its content).
INIT_FROM_TAG = "asrflow.init_from"
#: URI schemes resolved through MLflow; anything else is a local path.
MLFLOW_SCHEMES = ("models:/", "runs:/")
#: The folder a local ``init_from`` must lie in: the train stage depends on it in dvc.yaml and Snakemake.
PRETRAINED_DIR = Path("pretrained")
#: Model fields that shape the encoder, with the params.yaml key that sets each.
ENCODER_FIELDS = {
    "input_dim": "features.num_mel_bins",
    "d_model": "train.model.d_model",
    "num_heads": "train.model.num_heads",
    "ffn_dim": "train.model.ffn_dim",
    "num_layers": "train.model.num_layers",
    "conv_kernel_size": "train.model.conv_kernel_size",
    "subsampling_channels": "train.model.subsampling_channels",
    "subsampling_norm": "train.model.subsampling_norm",
}
#: Feature settings the encoder was trained on: another rate or frame gives its weights other inputs.
FEATURE_FIELDS = ("sampling_rate", "num_mel_bins", "frame_shift_s", "frame_length_s")


@dataclass(frozen=True, kw_only=True)
class FinetuneConfig:
    """params.yaml's ``train.finetune`` section (each key is documented there): the model a run starts from."""

    init_from: str | None
    freeze_encoder_steps: int
    encoder_lr_scale: float

    def __post_init__(self) -> None:
        check_at_least(self, SECTION, 0, "freeze_encoder_steps")
        check_positive(self, SECTION, "encoder_lr_scale")
        if self.init_from is not None and not self.init_from.strip():
            raise param_error(
                SECTION, "init_from", self.init_from, "must be null, a model bundle path or an MLflow model URI"
            )
        if self.init_from is None and (self.freeze_encoder_steps or self.encoder_lr_scale != 1.0):
            raise param_error(
                SECTION,
                "init_from",
                None,
                "must name a model when freeze_encoder_steps or encoder_lr_scale is set (they act on its encoder)",
            )


@dataclass(kw_only=True)
class InitModel:
    """A trained model read for fine-tuning: its ``weights`` (CPU tensors, emptied once applied), shape,
    features and tokenizer pieces; ``source`` as the params name it and ``digest`` of the bundle's bytes."""

    source: str
    digest: str
    #: Its :func:`~asrflow.model.conformer_ctc.shape_record`.
    shape: dict
    features: dict
    pieces: list[str]
    weights: dict[str, torch.Tensor] = field(repr=False)

    def fingerprint(self) -> dict:
        """What a resumed run must have started from: the source as named and its content."""
        return {"init.from": self.source, "init.digest": self.digest}


def is_mlflow_uri(source: str) -> bool:
    return source.startswith(MLFLOW_SCHEMES)


def load_init_model(source: str, *, tracking_uri: str | None = None) -> InitModel:
    """Read the model ``source`` names (a bundle path, or an MLflow model URI looked up in ``tracking_uri``,
    default ``$MLFLOW_TRACKING_URI`` or ``sqlite:///mlflow.db``); one :class:`AsrflowError` line when it
    is missing or not an asrflow model."""
    if is_mlflow_uri(source):
        with tempfile.TemporaryDirectory(prefix="asrflow-init-") as folder:
            return _read(source, _download(source, tracking_uri, Path(folder)))
    path = Path(source)
    if not path.is_file():
        raise AsrflowError(
            f"{KEY}: {source}: no such file; name a model bundle (the exp/model.pt of a trained run) or an MLflow "
            "model URI (models:/<name>/<version>, models:/<model id>, runs:/<run id>/model)"
        )
    return _read(source, path)


def _download(uri: str, tracking_uri: str | None, folder: Path) -> Path:
    """The bundle file of the MLflow model ``uri``, downloaded into ``folder``."""
    import mlflow.artifacts
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    store = check_tracking_uri(tracking_uri)  # an unreachable server is named before MLflow retries it
    create_whole_sqlite_store(store)  # never half-made by MLflow, nor beside the Trainer's child making it
    try:
        with _use_tracking_uri(store):  # models:/ URIs are looked up in the process-wide registry
            local = Path(
                mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(folder), tracking_uri=store)
            )
    except Exception as error:
        raise AsrflowError(
            f"{KEY}: {uri}: not found in the MLflow store {store} ({first_line(error)}); check the name, version "
            "or run id, or set MLFLOW_TRACKING_URI to the store that holds it"
        ) from None
    # runs:/<id>/model brings the run's copy of the bundle and its logged model's: the same bytes
    files = [local] if local.is_file() else sorted(local.rglob("*.pt"))
    bundles = {hashlib.sha256(path.read_bytes()).digest(): path for path in reversed(files)}
    if len(bundles) != 1:
        raise AsrflowError(
            f"{KEY}: {uri} in {store} is not an asrflow model: it holds {len(bundles)} distinct .pt files, one model "
            "bundle expected (a model the train stage logged)"
        )
    return next(iter(bundles.values()))


def _read(source: str, path: Path) -> InitModel:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    try:
        payload = read_bundle(path)
        config_from_record(payload["model_config"])  # a record that builds no model is not a model
        shape = dict(payload["model_config"])
        pieces = Tokenizer(payload["tokenizer"].numpy().tobytes()).pieces
        weights, features = payload["model"], payload["features"]
    except (AsrflowError, KeyError, TypeError, RuntimeError) as error:
        raise AsrflowError(f"{KEY}: {source} is not an asrflow model ({first_line(error)})") from None
    return InitModel(source=source, digest=digest, shape=shape, features=features, pieces=pieces, weights=weights)


def check_compatible(init: InitModel, model_config: ModelConfig, features: FeatureConfig) -> None:
    """Refuse an init model whose encoder has another shape, or was trained on other features, than the params
    ask for: one line naming each difference as ``key params-value vs init-value``."""
    ours = shape_record(model_config, input_dim=features.num_mel_bins, vocab_size=0)
    config, input_dim, vocab_size = config_from_record(init.shape)
    theirs = shape_record(config, input_dim=input_dim, vocab_size=vocab_size)
    differences = [
        f"{key} {ours[name]} vs {theirs[name]}" for name, key in ENCODER_FIELDS.items() if ours[name] != theirs[name]
    ]
    our_features = asdict(features)
    differences += [
        f"features.{name} {our_features[name]} vs {init.features.get(name)}"
        for name in FEATURE_FIELDS
        if name != "num_mel_bins" and our_features[name] != init.features.get(name)
    ]
    if differences:
        raise AsrflowError(
            f"{KEY}: {init.source} does not match params.yaml (params vs the model): {'; '.join(differences)}; "
            "set those params to the model's, or start from another model"
        )


def apply_init(model: nn.Module, init: InitModel, pieces: list[str]) -> dict[str, str]:
    """Load ``init``'s encoder into ``model``, and its CTC head when its tokenizer has the same ``pieces`` (in
    id order); returns the run's tags naming the start model. Draws nothing from the RNG; ``init.weights`` is
    emptied."""
    same_vocabulary = init.pieces == pieces
    weights = {
        name: value for name, value in init.weights.items() if same_vocabulary or not name.startswith(HEAD_PREFIX)
    }
    missing, unexpected = model.load_state_dict(weights, strict=False)
    encoder_missing = [name for name in missing if not name.startswith(HEAD_PREFIX)]
    if encoder_missing or unexpected:
        raise AsrflowError(
            f"{KEY}: {init.source} is not an asrflow model of this version "
            f"(missing {encoder_missing[:3]}, unexpected {unexpected[:3]})"
        )
    init.weights = {}
    if same_vocabulary:
        logger.info("initialised from %s: encoder and CTC head (same tokenizer)", init.source)
    else:
        logger.info(
            "initialised from %s: encoder only; its tokenizer differs (%s), so the CTC head is drawn fresh",
            init.source,
            _vocabulary_difference(init.pieces, pieces),
        )
    head = "loaded" if same_vocabulary else "drawn (other tokenizer)"
    return {INIT_FROM_TAG: init.source, "asrflow.init_digest": init.digest, "asrflow.init_head": head}


def _vocabulary_difference(theirs: list[str], ours: list[str]) -> str:
    if len(theirs) != len(ours):
        return f"{len(theirs)} pieces vs {len(ours)} here"
    index = next(i for i, (a, b) in enumerate(zip(theirs, ours, strict=True)) if a != b)
    return f"piece {index} is {theirs[index]!r} there, {ours[index]!r} here"


def encoder_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter of ``model`` but the CTC head's."""
    return [param for name, param in model.named_parameters() if not name.startswith(HEAD_PREFIX)]


def check_declared(source: str | None) -> None:
    """The train stage's rule: a local ``init_from`` lies under :data:`PRETRAINED_DIR` (relative to the working
    directory, the repository), the folder dvc.yaml and the Snakemake rule declare as its dependency, so a
    changed model re-runs training under both tools. An MLflow URI is a param only."""
    if source is None or is_mlflow_uri(source):
        return
    if not Path(os.path.abspath(source)).is_relative_to(Path(os.path.abspath(PRETRAINED_DIR))):
        raise AsrflowError(
            f"{KEY}: {source} is outside {PRETRAINED_DIR}/, the folder the train stage depends on (dvc.yaml, "
            f"Snakemake): copy it there (cp {source} {PRETRAINED_DIR}/) and set init_from: "
            f"{PRETRAINED_DIR}/{Path(source).name}, or log it to MLflow and name its models:/ URI"
        )
