"""A training run small enough to train in seconds on one CPU core: params.yaml with a few overrides."""

from __future__ import annotations

from pathlib import Path

#: The tiny run's ``train.model``: a one-layer Conformer of width 32 (with d_model channels in its front end).
TINY_MODEL = {
    "d_model": 32,
    "num_heads": 2,
    "ffn_dim": 64,
    "num_layers": 1,
    "conv_kernel_size": 7,
    "dropout": 0.1,
    "subsampling_channels": None,
}
#: What the tiny run changes in params.yaml: the model above, short epochs of small batches with SpecAugment on
#: (as a corpus of hours trains; params.yaml has it off for yesno), frequent checkpoints that are all kept, and
#: data loading in the training process.
TINY_OVERRIDES = {
    "train": {
        "model": TINY_MODEL,
        "data": {"max_duration_s": 30.0, "num_buckets": 10, "spec_augment": True},
        "optim": {"epochs": 2, "warmup_steps": 5, "num_threads": 1, "average_last": 1},
        "checkpoint": {"checkpoint_every_steps": 4, "validate_every_steps": 4, "keep_last": 20},
    },
    "run": {"num_workers": 0},
}


def tiny_params(data: Path | None = None, overrides: dict | None = None, *, seed: int = 42) -> dict:
    """params.yaml with :data:`TINY_OVERRIDES`, the ``features`` section ``data`` was computed with (when
    given), ``seed``, and ``overrides`` (dotted keys such as ``{"train.optim.epochs": 3}``, or sections)."""
    from asrflow.params import with_overrides
    from tests.support.corpora import params_for
    from tests.support.repo import repo_params

    params = with_overrides(repo_params(), TINY_OVERRIDES, "the tiny run")
    if data is not None:
        params = params_for(Path(data), params)
    params["seed"] = seed
    return with_overrides(params, overrides or {}, "test overrides")


def tiny_model_config(**changes):
    """The tiny run's ``train.model`` section (:data:`TINY_MODEL` over params.yaml's) with ``changes`` (keys of
    the section), built and checked as params.yaml's is: for tests that build a model themselves, with
    :func:`~asrflow.model.conformer_ctc.build_model`."""
    from asrflow.model.conformer_ctc import SECTION, ModelConfig
    from asrflow.params import build_config

    section = {**tiny_params()["train"]["model"], **changes}
    return build_config(ModelConfig, section, SECTION)


def tiny_settings(data: Path | None = None, overrides: dict | None = None, *, seed: int = 42):
    """The :class:`~asrflow.training.assemble.TrainingSettings` of :func:`tiny_params`."""
    from asrflow.training.settings import TrainingSettings

    return TrainingSettings.from_params(tiny_params(data, overrides, seed=seed))


def tiny_trainer(data: Path, exp: Path, overrides: dict | None = None, *, seed: int = 42, **options):
    """The tiny run's Trainer on ``data`` (``fbank/``, ``lang/``), writing under ``exp``, assembled as the train
    stage assembles it; ``options`` are :func:`~asrflow.training.assemble.build_trainer`'s (``tracking_uri``,
    ``observers``)."""
    from asrflow.training.assemble import build_trainer

    options.setdefault("tracking_uri", f"sqlite:///{Path(exp) / 'mlflow.db'}")
    return build_trainer(tiny_settings(data, overrides, seed=seed), train_paths(data, exp), **options)


def tiny_train_data(data: Path, overrides: dict | None = None, *, seed: int = 42):
    """The tiny run's :class:`~asrflow.training.train_data.TrainData` on ``data`` (``fbank/``, ``lang/``), built
    from :func:`tiny_settings` as the Trainer builds it (one process, no process group)."""
    from asrflow.training.parts import RunPlace, build_train_data

    settings = tiny_settings(data, overrides, seed=seed)
    return build_train_data(settings, train_paths(data, Path(data) / "exp"), RunPlace.single())


def train_paths(data: Path, exp: Path):
    """``TrainPaths`` reading ``data`` (``fbank/``, ``lang/``) and writing under ``exp``."""
    from asrflow.training.config import TrainPaths

    return TrainPaths.under(exp, fbank_dir=Path(data) / "fbank", lang_dir=Path(data) / "lang")


def tiny_bundle(path: Path, lang: Path, *, seed: int, **model) -> dict:
    """Write a model bundle of drawn (untrained) weights of the tiny model, ``model`` overriding its shape, with
    the tokenizer in ``lang`` (``DATA/lang``) and the features ``DATA/fbank`` was computed with (what the tiny run
    on ``DATA`` trains with): a start model for fine-tuning tests. Returns its weights."""
    import torch

    from asrflow.serving.bundle import save_bundle
    from asrflow.tokenizer import MODEL_FILE, Tokenizer
    from asrflow.training.parts import build_run_model

    tokenizer = Tokenizer(Path(lang) / MODEL_FILE)
    overrides = {f"train.model.{key}": value for key, value in model.items()}
    settings = tiny_settings(Path(lang).parent, overrides)
    features = settings.features
    torch.manual_seed(seed)
    built = build_run_model(settings, vocab_size=tokenizer.vocab_size)
    save_bundle(
        path,
        model_state=built.state_dict(),
        model_shape=built.shape,
        tokenizer=tokenizer,
        features=features,
        cmvn={},
        run_id=None,
    )
    weights = built.state_dict()
    return weights
