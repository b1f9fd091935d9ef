"""Each part of a training run, built from its settings: the one place they are built.

The train stage (through :func:`~asrflow.training.assemble.build_trainer`), the tuner, every benchmark and the
test harness build the data, the model, the step context (optimizer, gradient scaler, precision), the schedule,
the non-finite guard, the validator, the fingerprint and the checkpoint manager with these functions, so what
they measure is what users train. Nothing here starts a process group, a tracker or a download: those happen
before, and their results (:class:`RunPlace`, an :class:`~asrflow.training.init_model.InitModel`) come in.

The order of :func:`build_run_parts` is part of a run's reproducibility: the RNG is seeded, then the data is
read, then the model's weights are drawn.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from asrflow.code_digest import source_digest
from asrflow.errors import AsrflowError
from asrflow.model.conformer_ctc import ConformerCtc, build_model
from asrflow.training.checkpoint_manager import CheckpointManager
from asrflow.training.config import TrainPaths
from asrflow.training.distributed import DistInfo
from asrflow.training.fingerprint import build_fingerprint, training_params
from asrflow.training.init_model import InitModel, check_compatible, encoder_parameters
from asrflow.training.nonfinite import NonFiniteGuard
from asrflow.training.run_state import seed_everything
from asrflow.training.step import StepContext, build_scheduler
from asrflow.training.train_data import TrainData
from asrflow.training.validation import Validator

if TYPE_CHECKING:
    from asrflow.training.settings import TrainingSettings

#: The module whose code (with everything it imports) is fingerprinted as the run's training code.
TRAINING_CODE = "asrflow.training.trainer"


@dataclass(frozen=True, kw_only=True)
class RunPlace:
    """Where this process trains: its place in the job (one process unless a process group was started) and
    its device."""

    dist: DistInfo
    device: torch.device

    @classmethod
    def single(cls, device: torch.device | None = None) -> RunPlace:
        """One process on ``device`` (default: the first GPU when there is one, else the CPU)."""
        return cls(dist=DistInfo(), device=device or default_device(DistInfo()))


def default_device(dist: DistInfo) -> torch.device:
    """This rank's GPU (its local rank's) when there is one, else the CPU."""
    return torch.device(f"cuda:{dist.local_rank}" if torch.cuda.is_available() else "cpu")


def check_consistent(settings: TrainingSettings, init_model: InitModel | None = None) -> None:
    """Refuse sections that contradict each other, before any data is read, naming both keys: a start model
    (``train.finetune.init_from``) of another shape or other features than ``train.model`` and ``features:``,
    speed perturbation over stored features, a SpecAugment band as wide as the model's input."""
    data, features = settings.train.data, settings.features
    if init_model is not None:
        check_compatible(init_model, settings.train.model, features)
    if data.speed_perturb and not features.on_the_fly:
        raise AsrflowError(
            "train.data.speed_perturb needs features.on_the_fly: true (speed perturbation changes the audio, "
            "and precomputed features have none): set features.on_the_fly: true or train.data.speed_perturb: false"
        )
    if data.spec_augment and data.num_freq_masks and data.freq_mask_width >= features.num_mel_bins:
        raise AsrflowError(
            f"train.data.freq_mask_width {data.freq_mask_width} must be below features.num_mel_bins "
            f"{features.num_mel_bins}, the model's input width (a mask that wide hides every bin): lower it"
        )


def build_train_data(
    settings: TrainingSettings,
    paths: TrainPaths,
    place: RunPlace,
    *,
    seed: int | None = None,
    accum_grad: int | None = None,
) -> TrainData:
    """This rank's :class:`TrainData` of ``settings`` over ``paths.fbank_dir`` and ``paths.lang_dir``, with the
    data workers the train stage starts on ``place``'s device; ``seed`` and ``accum_grad`` replace the
    settings' own (a benchmark's other draw of the same data)."""
    check_consistent(settings)
    optim, run, features = settings.train.optim, settings.run, settings.features
    return TrainData.build(
        settings.train.data,
        features,
        epochs=optim.epochs,
        accum_grad=optim.accum_grad if accum_grad is None else accum_grad,
        num_workers=run.data_workers(features.on_the_fly, gpu=place.device.type == "cuda"),
        mp_start_method=run.mp_start_method,
        seed=settings.seed if seed is None else seed,
        fbank_dir=paths.fbank_dir,
        lang_dir=paths.lang_dir,
        dist=place.dist,
    )


def build_run_model(settings: TrainingSettings, *, vocab_size: int, device: torch.device | None = None) -> ConformerCtc:
    """``train.model``'s Conformer-CTC over ``features.num_mel_bins`` fbank bins and ``vocab_size`` pieces, its
    weights drawn from the torch RNG as it stands, on ``device`` (default: the CPU)."""
    model = build_model(settings.train.model, input_dim=settings.features.num_mel_bins, vocab_size=vocab_size)
    return model.to(device) if device is not None else model


def build_step_context(
    settings: TrainingSettings, model: torch.nn.Module, place: RunPlace, *, precision: str | None = None
) -> StepContext:
    """What every step of ``model`` uses, as ``train.optim`` and ``train.finetune.encoder_lr_scale`` ask: AdamW,
    the precision for ``place``'s device (``precision`` replaces ``train.optim.precision``: the tuner's
    candidates) with its gradient scaler, clipping, and dropout seeded per planned batch."""
    optim = settings.train.optim if precision is None else replace(settings.train.optim, precision=precision)
    return StepContext.for_run(
        model,
        optim,
        encoder_lr_scale=settings.train.finetune.encoder_lr_scale,
        dist=place.dist,
        device=place.device,
        seed=settings.seed,
    )


def build_validator(settings: TrainingSettings, data: TrainData, context: StepContext, place: RunPlace) -> Validator:
    """The dev loss every ``train.checkpoint.validate_every_steps``, in the step's precision (none without dev
    batches)."""
    dev_loss = functools.partial(data.dev_loss, precision=context.precision, dist=place.dist, device=place.device)
    every = settings.train.checkpoint.validate_every_steps
    return Validator(every, dev_loss if data.dev_batches else None)


def run_fingerprint(
    settings: TrainingSettings, model: ConformerCtc, data: TrainData, init_model: InitModel | None
) -> dict[str, Any]:
    """What makes a checkpoint this run's: the model's shape, the features, the data, the seed, the training
    config and the start model (a resume with any of them changed is refused)."""
    init = init_model.fingerprint() if init_model is not None else None
    return build_fingerprint(
        model.shape,
        asdict(settings.features),
        data_digest=data.digest,
        seed=settings.seed,
        config=settings.train,
        init=init,
    )


@dataclass(kw_only=True)
class RunParts:
    """The built parts of one run, which the Trainer's loop calls. ``frozen``: the encoder's parameters while
    ``train.finetune.freeze_encoder_steps`` lasts (else empty); ``train_params``: the params a resume must
    share, with the training code's digest."""

    data: TrainData
    model: ConformerCtc
    init_model: InitModel | None
    frozen: list[torch.nn.Parameter]
    step_context: StepContext
    scheduler: torch.optim.lr_scheduler.LambdaLR
    guard: NonFiniteGuard
    validator: Validator
    fingerprint: dict[str, Any]
    train_params: dict[str, Any]
    checkpoints: CheckpointManager


def build_run_parts(
    settings: TrainingSettings, paths: TrainPaths, place: RunPlace, *, init_model: InitModel | None = None
) -> RunParts:
    """Every part of the run ``settings`` describes, reading and writing ``paths``, on ``place``, starting from
    ``init_model`` (``train.finetune.init_from``, loaded by the caller) when given. Contradicting sections are
    refused first (:func:`check_consistent`)."""
    check_consistent(settings, init_model)
    config = settings.train
    seed_everything(settings.seed)
    data = build_train_data(settings, paths, place)
    model = build_run_model(settings, vocab_size=data.tokenizer.vocab_size, device=place.device)
    context = build_step_context(settings, model, place)
    fingerprint = run_fingerprint(settings, model, data, init_model)
    train_params = training_params(config, settings.run, source_digest(TRAINING_CODE))
    facts = {"fingerprint": fingerprint, "train_params": train_params, "precision": context.precision.name}
    return RunParts(
        data=data,
        model=model,
        init_model=init_model,
        frozen=encoder_parameters(model) if config.finetune.freeze_encoder_steps else [],
        step_context=context,
        scheduler=build_scheduler(context.optimizer, config.optim.warmup_steps),
        guard=NonFiniteGuard.for_run(config.nonfinite, Path(paths.bad_batches), writes_records=place.dist.is_main),
        validator=build_validator(settings, data, context, place),
        fingerprint=fingerprint,
        train_params=train_params,
        checkpoints=CheckpointManager.for_run(config.checkpoint, paths.checkpoint_dir, dist=place.dist, facts=facts),
    )
