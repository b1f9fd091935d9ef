"""A model and training config small enough to train in seconds on one CPU core."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

#: The model part of :func:`tiny_train_config`: a one-layer Conformer of width 32.
TINY_MODEL = {"d_model": 32, "num_heads": 2, "ffn_dim": 64, "num_layers": 1, "conv_kernel_size": 7}


def tiny_train_config(**overrides):
    """A ``TrainConfig`` for a one-layer Conformer of width 32, with ``overrides`` applied."""
    from asrflow.training.config import TrainConfig

    tiny = TrainConfig(
        **TINY_MODEL,
        dropout=0.1,
        max_duration_s=30.0,
        num_buckets=10,
        num_workers=0,
        epochs=2,
        warmup_steps=5,
        num_threads=1,
        checkpoint_every_steps=4,
        validate_every_steps=4,
        keep_last=20,
        average_last=1,
    )
    return replace(tiny, **overrides)


def train_paths(data: Path, exp: Path):
    """``TrainPaths`` reading ``data`` (``fbank/``, ``lang/``) and writing under ``exp``."""
    from asrflow.training.config import TrainPaths

    return TrainPaths.under(exp, fbank_dir=Path(data) / "fbank", lang_dir=Path(data) / "lang")


def tiny_bundle(path: Path, lang: Path, *, seed: int, **model) -> dict:
    """Write a model bundle of drawn (untrained) weights of the tiny model, ``model`` overriding its shape, with
    the tokenizer in ``lang`` and the default features: a start model for fine-tuning tests. Returns its weights."""
    import torch

    from asrflow.data.features import FeatureConfig
    from asrflow.model.conformer_ctc import build_model
    from asrflow.serving.bundle import save_bundle
    from asrflow.tokenizer import MODEL_FILE, Tokenizer

    tokenizer = Tokenizer(Path(lang) / MODEL_FILE)
    config = tiny_train_config(**model).model(FeatureConfig().num_mel_bins, tokenizer.vocab_size)
    torch.manual_seed(seed)
    weights = build_model(config).state_dict()
    features = FeatureConfig()
    save_bundle(
        path, model_state=weights, model_config=config, tokenizer=tokenizer, features=features, cmvn={}, run_id=None
    )
    return weights
