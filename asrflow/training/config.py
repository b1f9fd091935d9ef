"""What a training run is told: the ``train:`` section of params.yaml as one typed config (every key
documented there), and the folders it reads and writes."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from asrflow.data.batches import AugmentConfig
from asrflow.errors import AsrflowError
from asrflow.model.conformer_ctc import ModelConfig
from asrflow.params import (
    check_at_least,
    check_choice,
    check_positive,
    check_type,
    param_error,
    require_mapping,
    set_param,
)
from asrflow.training.precision import CHOICES as PRECISIONS

SECTION = "train"
#: Accepted values of ``run.mp_start_method`` (Python's multiprocessing start methods).
START_METHODS = ("spawn", "forkserver", "fork")

#: Data workers ``num_workers: auto`` starts when features are computed on the fly.
AUTO_WORKERS_ON_THE_FLY = 2

#: Where each key lives in params.yaml. ``train.*`` sections are the train stage's params (a change
#: re-runs training) except ``train.checkpoint``; ``run`` holds how and where this run executes, which
#: no stage's outputs depend on.
TRAIN_LAYOUT: dict[str, tuple[str, ...]] = {
    "train.model": (
        "d_model",
        "num_heads",
        "ffn_dim",
        "num_layers",
        "conv_kernel_size",
        "dropout",
        "attention_dropout",
        "subsampling_channels",
        "subsampling_norm",
        "blank_bias_init",
    ),
    "train.data": (
        "max_duration_s",
        "num_buckets",
        "spec_augment",
        "num_freq_masks",
        "freq_mask_width",
        "num_time_masks",
        "time_mask_ratio",
        "speed_perturb",
        "noise_dir",
        "noise_snr_db",
        "corpus_weights",
    ),
    "train.optim": (
        "epochs",
        "lr",
        "weight_decay",
        "warmup_steps",
        "max_grad_norm",
        "accum_grad",
        "precision",
        "num_threads",
        "average_last",
    ),
    "train.nonfinite": ("max_consecutive_nonfinite", "rollback_lr_factor", "max_rollbacks"),
    "train.finetune": ("init_from", "freeze_encoder_steps", "encoder_lr_scale"),
    "train.checkpoint": ("checkpoint_every_steps", "keep_last", "validate_every_steps"),
    "run": (
        "experiment",
        "register_model_name",
        "num_workers",
        "mp_start_method",
        "nproc_per_node",
        "nnodes",
        "node_rank",
        "rdzv_endpoint",
        "dist_timeout_s",
        "stall_timeout_s",
    ),
}

#: Each key's section, e.g. ``KEY_SECTION["lr"] == "train.optim"``.
KEY_SECTION = {key: section for section, keys in TRAIN_LAYOUT.items() for key in keys}

#: Keys that may change between an interrupted run and its resume without changing what
#: the resumed steps compute (bookkeeping, parallel loading, time limits).
OPERATIONAL_KEYS = frozenset(
    {"epochs", "average_last", "max_consecutive_nonfinite", "max_rollbacks"}
    | set(TRAIN_LAYOUT["train.checkpoint"])
    | set(TRAIN_LAYOUT["run"]) - {"nproc_per_node", "nnodes"}
)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Training hyper-parameters; see params.yaml for what each one means."""

    d_model: int = 144
    num_heads: int = 4
    ffn_dim: int = 576
    num_layers: int = 2
    conv_kernel_size: int = 15
    dropout: float = 0.1
    attention_dropout: float = 0.0
    subsampling_channels: list[int] | None = None
    subsampling_norm: bool = True
    blank_bias_init: float | None = 3.0
    max_duration_s: float = 120.0
    num_buckets: int = 30
    num_workers: int | str = "auto"
    spec_augment: bool = True
    num_freq_masks: int = 2
    freq_mask_width: int = 15
    num_time_masks: int = 2
    time_mask_ratio: float = 0.05
    speed_perturb: bool = False
    noise_dir: str | None = None
    noise_snr_db: list[float] = field(default_factory=lambda: [10.0, 20.0])
    corpus_weights: dict[str, float] = field(default_factory=dict)
    epochs: int = 40
    lr: float = 0.003
    weight_decay: float = 0.001
    warmup_steps: int = 40
    max_grad_norm: float = 5.0
    accum_grad: int = 1
    precision: str = "auto"
    num_threads: int = 2
    checkpoint_every_steps: int = 50
    keep_last: int = 3
    validate_every_steps: int = 50
    average_last: int = 3
    max_consecutive_nonfinite: int = 5
    rollback_lr_factor: float = 0.5
    max_rollbacks: int = 3
    init_from: str | None = None
    freeze_encoder_steps: int = 0
    encoder_lr_scale: float = 1.0
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = "localhost:29500"
    dist_timeout_s: float = 300.0
    stall_timeout_s: float = 900.0
    mp_start_method: str = "spawn"
    experiment: str = "asrflow"
    register_model_name: str | None = None

    def __post_init__(self) -> None:
        self._check_model()
        self._check_data()
        self._check_optimisation()
        self._check_bookkeeping()

    def _check_model(self) -> None:
        check_at_least(self, KEY_SECTION, 1, "d_model", "num_heads", "ffn_dim", "num_layers", "conv_kernel_size")
        if self.d_model % self.num_heads:
            raise AsrflowError(
                f"params.yaml: train.model.num_heads ({self.num_heads}) must divide "
                f"train.model.d_model ({self.d_model})"
            )
        if self.conv_kernel_size % 2 == 0:
            raise param_error(KEY_SECTION, "conv_kernel_size", self.conv_kernel_size, "must be odd (e.g. 15)")
        channels = self.subsampling_channels
        if channels is not None and (
            len(channels) != 2 or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in channels)
        ):
            raise param_error(
                KEY_SECTION,
                "subsampling_channels",
                channels,
                "must be null (d_model each) or two positive integers, e.g. [64, 32]",
            )
        if not 0.0 <= self.dropout < 1.0:
            raise param_error(KEY_SECTION, "dropout", self.dropout, "must be in [0, 1)")

    def _check_data(self) -> None:
        check_positive(self, KEY_SECTION, "max_duration_s")
        check_at_least(self, KEY_SECTION, 1, "num_buckets")
        if isinstance(self.num_workers, str):
            if self.num_workers != "auto":
                raise param_error(KEY_SECTION, "num_workers", self.num_workers, "must be auto or an integer >= 0")
        else:
            check_at_least(self, KEY_SECTION, 0, "num_workers")
        check_at_least(self, KEY_SECTION, 0, "num_freq_masks", "freq_mask_width", "num_time_masks")
        if not 0.0 <= self.time_mask_ratio <= 1.0:
            raise param_error(KEY_SECTION, "time_mask_ratio", self.time_mask_ratio, "must be in [0, 1]")
        snr = self.noise_snr_db
        if len(snr) != 2 or snr[0] > snr[1]:
            raise param_error(
                KEY_SECTION, "noise_snr_db", snr, "must be two numbers [low, high] with low <= high, e.g. [10, 20]"
            )
        for name, weight in self.corpus_weights.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
                raise AsrflowError(
                    f"params.yaml: train.data.corpus_weights.{name} = {weight!r} must be a number > 0 "
                    "(a corpus' share of an epoch is its weight x its utterances; one left out has weight 1)"
                )

    def _check_optimisation(self) -> None:
        check_positive(self, KEY_SECTION, "lr", "max_grad_norm")
        check_at_least(self, KEY_SECTION, 1, "epochs", "accum_grad", "num_threads")
        check_at_least(self, KEY_SECTION, 0, "weight_decay", "warmup_steps")
        check_choice(self, KEY_SECTION, "precision", PRECISIONS)
        check_at_least(self, KEY_SECTION, 0, "freeze_encoder_steps")
        check_positive(self, KEY_SECTION, "encoder_lr_scale")
        if self.init_from is not None and not self.init_from.strip():
            raise param_error(
                KEY_SECTION, "init_from", self.init_from, "must be null, a model bundle path or an MLflow model URI"
            )
        if self.init_from is None and (self.freeze_encoder_steps or self.encoder_lr_scale != 1.0):
            raise param_error(
                KEY_SECTION,
                "init_from",
                None,
                "must name a model when freeze_encoder_steps or encoder_lr_scale is set (they act on its encoder)",
            )

    def _check_bookkeeping(self) -> None:
        check_at_least(
            self,
            KEY_SECTION,
            1,
            "checkpoint_every_steps",
            "keep_last",
            "average_last",
            "max_consecutive_nonfinite",
            "nproc_per_node",
            "nnodes",
        )
        check_at_least(self, KEY_SECTION, 0, "validate_every_steps", "max_rollbacks", "node_rank", "stall_timeout_s")
        check_positive(self, KEY_SECTION, "dist_timeout_s")
        if not 0.0 < self.rollback_lr_factor <= 1.0:
            raise param_error(KEY_SECTION, "rollback_lr_factor", self.rollback_lr_factor, "must be in (0, 1]")
        if self.node_rank >= self.nnodes:
            raise param_error(KEY_SECTION, "node_rank", self.node_rank, f"must be below run.nnodes ({self.nnodes})")
        check_choice(self, KEY_SECTION, "mp_start_method", START_METHODS)
        if not self.experiment.strip():
            raise param_error(KEY_SECTION, "experiment", self.experiment, "must name an MLflow experiment")
        if self.register_model_name is not None and not self.register_model_name.strip():
            raise param_error(
                KEY_SECTION, "register_model_name", self.register_model_name, "must be null or a registered-model name"
            )

    def data_workers(self, on_the_fly: bool) -> int:
        """Data-loading processes: ``num_workers``, or for ``auto`` 0 with precomputed features (a batch of
        stored fbank loads quickly in the training process, and each spawned worker would import torch again)
        and :data:`AUTO_WORKERS_ON_THE_FLY` when ``features.on_the_fly`` computes features from audio while
        training (bench/RESULTS.md)."""
        if self.num_workers == "auto":
            return AUTO_WORKERS_ON_THE_FLY if on_the_fly else 0
        return int(self.num_workers)

    def model(self, input_dim: int, vocab_size: int) -> ModelConfig:
        """The model shape: ``input_dim`` fbank bins in, ``vocab_size`` classes (blank included) out."""
        shape = {
            field.name: getattr(self, field.name)
            for field in fields(ModelConfig)
            if field.name not in ("input_dim", "vocab_size")
        }
        return ModelConfig(input_dim=input_dim, vocab_size=vocab_size, **shape)

    def augment(self) -> AugmentConfig:
        """The augmentation part of this config."""
        return AugmentConfig(
            spec_augment=self.spec_augment,
            num_freq_masks=self.num_freq_masks,
            freq_mask_width=self.freq_mask_width,
            num_time_masks=self.num_time_masks,
            time_mask_ratio=self.time_mask_ratio,
            speed_perturb=self.speed_perturb,
            noise_snr_db=(float(self.noise_snr_db[0]), float(self.noise_snr_db[1])),
        )


@dataclass(frozen=True, kw_only=True)
class TrainPaths:
    """Inputs (features, tokenizer) and outputs (model bundle, checkpoints, plots) of the train stage."""

    fbank_dir: Path = Path("data/fbank")
    lang_dir: Path = Path("data/lang")
    model_path: Path = Path("exp/model.pt")
    checkpoint_dir: Path = Path("exp/checkpoints")
    loss_csv: Path = Path("exp/plots/train_loss.csv")
    bad_batches: Path = Path("exp/bad_batches.jsonl")

    @classmethod
    def under(cls, exp_dir: str | Path, *, fbank_dir: str | Path, lang_dir: str | Path) -> TrainPaths:
        """Paths that read ``fbank_dir`` and ``lang_dir`` and write everything under ``exp_dir``."""
        exp = Path(exp_dir)
        return cls(
            fbank_dir=Path(fbank_dir),
            lang_dir=Path(lang_dir),
            model_path=exp / "model.pt",
            checkpoint_dir=exp / "checkpoints",
            loss_csv=exp / "plots" / "train_loss.csv",
            bad_batches=exp / "bad_batches.jsonl",
        )


def _section(params: dict[str, Any], path: str) -> dict[str, Any]:
    node: Any = params
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return require_mapping(node, path)


def load_train_config(params: dict[str, Any]) -> TrainConfig:
    """The train stage's config from params.yaml's ``train:`` sections and its ``run:`` section.

    A key in the wrong section, an unknown key, or the old flat ``train:`` layout ends in one
    :class:`AsrflowError` that names each key and where it belongs.
    """
    train = require_mapping(params.get("train"), "train")
    moved = [f"train.{key} -> {KEY_SECTION[key]}.{key}" for key in train if key in KEY_SECTION]
    if moved:
        raise AsrflowError(
            "params.yaml: train: is split into sections (train.model, train.data, train.optim, train.nonfinite, "
            f"train.finetune, train.checkpoint) and run:; move each key: {', '.join(moved)}"
        )
    subsections = {path.split(".", 1)[1] for path in TRAIN_LAYOUT if path.startswith("train.")}
    unknown = sorted(set(train) - subsections)
    if unknown:
        raise AsrflowError(
            f"params.yaml: unknown section(s) {', '.join(f'train.{name}' for name in unknown)}; "
            f"train: holds {', '.join(sorted(subsections))}"
        )
    hints = typing.get_type_hints(TrainConfig)
    values: dict[str, Any] = {}
    for path, keys in TRAIN_LAYOUT.items():
        for key, value in _section(params, path).items():
            if key not in keys:
                home = KEY_SECTION.get(key)
                hint = f"; it belongs in {home}" if home else f"; valid keys: {', '.join(keys)}"
                raise AsrflowError(f"params.yaml: unknown key {path}.{key}{hint}")
            check_type(value, hints[key], f"{path}.{key}")
            values[key] = value
    return TrainConfig(**values)


def set_train_keys(params: dict[str, Any], values: dict[str, Any]) -> None:
    """Set train-stage keys by name (``{"lr": 0.001}``) in a params dict, each in its section."""
    for key, value in values.items():
        set_param(params, f"{KEY_SECTION[key]}.{key}", value)
