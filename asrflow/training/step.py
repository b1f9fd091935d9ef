"""The optimizer, its learning-rate schedule, and one optimizer step: forward/backward over the
accumulated micro-batches, then the update.

Loss normalisation: the step's loss is the sum of per-utterance CTC losses (nats) over
every micro-batch on every rank, divided by the number of target tokens in all of them
(``step_tokens``, known to every rank from the plan, so no collective is needed). Each
rank backpropagates ``local_sum / step_tokens * world_size``; DDP's gradient averaging
divides by ``world_size`` again, so ``accum_grad`` micro-batches on ``w`` ranks give the
update of one process holding the ``accum_grad * w``-fold batch. DDP synchronises
gradients only on the last micro-batch (``no_sync`` on the others).

Dropout: before each micro-batch's forward pass the torch RNG is seeded from ``(seed,
epoch, batch index)``, as the batch's augmentation is. The masks then depend only on which
planned batch it is, not on the rank, the number of ranks or where a resumed run started:
``w`` ranks train exactly as one process with the same global batch would, and a resume
(on any rank) continues exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asrflow.model.conformer_ctc import HEAD_PREFIX
from asrflow.params import check_at_least, check_choice, check_positive
from asrflow.tokenizer import BLANK_ID
from asrflow.training.distributed import DistInfo, agree_on_step
from asrflow.training.precision import CHOICES as PRECISIONS
from asrflow.training.precision import PrecisionPolicy, precision_for

SECTION = "train.optim"


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """params.yaml's ``train.optim`` section (each key is documented there): the optimizer, its schedule, the
    precision and the length of the run."""

    epochs: int
    lr: float
    weight_decay: float
    warmup_steps: int
    max_grad_norm: float
    accum_grad: int
    precision: str
    num_threads: int
    average_last: int

    def __post_init__(self) -> None:
        check_positive(self, SECTION, "lr", "max_grad_norm")
        check_at_least(self, SECTION, 1, "epochs", "accum_grad", "num_threads", "average_last")
        check_at_least(self, SECTION, 0, "weight_decay", "warmup_steps")
        check_choice(self, SECTION, "precision", PRECISIONS)


@dataclass(kw_only=True)
class StepResult:
    """What one optimizer step did. ``loss`` is per token (global), ``grad_norm`` before clipping.

    The training loop adds the step's number (``step``, counted over the whole run), its wall time
    (``elapsed_s``, data wait included), the part spent waiting for batches (``data_wait_s``) and
    every cut id of the step (all ranks).
    """

    loss: float
    grad_norm: float
    finite: bool
    stop: bool
    num_utterances: int
    audio_seconds: float
    padding_ratio: float
    step: int = 0
    elapsed_s: float = 0.0
    data_wait_s: float = 0.0
    cut_ids: tuple[str, ...] = ()


def build_optimizer(
    model: torch.nn.Module, *, lr: float, weight_decay: float, encoder_lr_scale: float = 1.0
) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters, in its fused kernel (CPU and CUDA): one pass over all
    parameters instead of a loop of small ones (bench/RESULTS.md#peer-speed). With ``encoder_lr_scale`` other
    than 1, the encoder (every parameter outside the CTC head) is a second group at ``lr * encoder_lr_scale``."""
    if encoder_lr_scale == 1.0:
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=True)
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if n.startswith(HEAD_PREFIX)]},
        {"params": [p for n, p in named if not n.startswith(HEAD_PREFIX)], "lr": lr * encoder_lr_scale},
    ]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, fused=True)


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Multiplier of the peak LR after ``step`` optimizer steps (peak 1.0 at ``warmup_steps``)."""
    step = max(step, 1)
    if warmup_steps <= 0:
        return 1.0
    return min(step / warmup_steps, (warmup_steps / step) ** 0.5)


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over :func:`warmup_factor`; its state is part of every checkpoint."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_factor(step + 1, warmup_steps))


def apply_lr_scale(scheduler: torch.optim.lr_scheduler.LambdaLR, factor: float) -> None:
    """Move each group's schedule peak to ``factor`` times its initial peak (after a rollback) and set the
    optimizer's current lr to match."""
    scheduler.base_lrs = [group["initial_lr"] * factor for group in scheduler.optimizer.param_groups]
    for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = base * scheduler.lr_lambdas[0](scheduler.last_epoch)


def ctc_loss_sum(log_probs: torch.Tensor, out_lens: torch.Tensor, batch: dict) -> torch.Tensor:
    """Sum over utterances of the CTC loss (nats); ``log_probs`` is (N, T', V)."""
    return F.ctc_loss(
        log_probs.transpose(0, 1).float(),  # (T', N, V)
        batch["targets"],
        out_lens,
        batch["target_lens"],
        blank=BLANK_ID,
        reduction="sum",
        zero_infinity=True,
    )


#: Keeps a batch's dropout stream apart from its augmentation stream (same seed, epoch, index).
_DROPOUT_STREAM = 1


def seed_dropout(seed: int, batch: dict) -> None:
    """Seed the torch RNG (dropout) from the run's ``seed`` and the batch's place in the plan."""
    item = batch["item"]
    entropy = [seed, item.epoch, item.batch_index, _DROPOUT_STREAM]
    torch.manual_seed(int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> 1))


@dataclass(frozen=True, kw_only=True)
class StepContext:
    """What every optimizer step of a run uses: the optimizer and its gradient scaler, the precision,
    the clipping norm, this process's place in the job and its device. With ``seed``, dropout is seeded
    per micro-batch (see :func:`seed_dropout`; batches then need their ``item``)."""

    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    precision: PrecisionPolicy
    max_grad_norm: float
    dist: DistInfo
    device: torch.device
    seed: int | None = None

    @classmethod
    def for_run(
        cls,
        model: nn.Module,
        optim: OptimConfig,
        *,
        encoder_lr_scale: float,
        dist: DistInfo,
        device: torch.device,
        seed: int,
    ) -> StepContext:
        """What ``optim`` asks for: AdamW over ``model`` (the encoder's learning rate scaled by
        ``encoder_lr_scale``), the precision for ``device`` and its gradient scaler."""
        precision = precision_for(optim.precision, device)
        optimizer = build_optimizer(
            model, lr=optim.lr, weight_decay=optim.weight_decay, encoder_lr_scale=encoder_lr_scale
        )
        return cls(
            optimizer=optimizer,
            scaler=precision.grad_scaler(),
            precision=precision,
            max_grad_norm=optim.max_grad_norm,
            dist=dist,
            device=device,
            seed=seed,
        )


def train_step(
    model: nn.Module,
    micro_batches: list[dict],
    context: StepContext,
    *,
    step_tokens: int,
    stop_requested: Callable[[], bool] = lambda: False,
    frozen: Sequence[nn.Parameter] = (),
) -> StepResult:
    """Accumulate gradients over ``micro_batches``, clip, and step unless anything is non-finite.

    ``frozen`` parameters lose their gradients before clipping: AdamW leaves them (and their moments) as
    they are.

    Every rank reaches the same decisions (apply the step? stop after it?) through one
    all-reduce, which also sums the loss for logging. ``stop_requested`` is read right
    before that all-reduce, so a signal that arrives during this step makes it the last one.
    """
    optimizer, scaler, precision = context.optimizer, context.scaler, context.precision
    dist, device = context.dist, context.device
    optimizer.zero_grad(set_to_none=True)
    local_loss = 0.0
    scale = dist.world_size / max(step_tokens, 1)
    for index, batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        sync = contextlib.nullcontext() if last or not dist.enabled else model.no_sync()
        with sync:
            if context.seed is not None:
                seed_dropout(context.seed, batch)
            with precision.autocast():
                log_probs, out_lens = model(batch["features"].to(device), batch["feature_lens"].to(device))
            targets = {key: batch[key].to(device) for key in ("targets", "target_lens")}
            loss_sum = ctc_loss_sum(log_probs, out_lens, targets)
            scaler.scale(loss_sum * scale).backward()
        local_loss += float(loss_sum.detach())
    for param in frozen:
        param.grad = None
    scaler.unscale_(optimizer)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), context.max_grad_norm))
    # With fp16 the scaler handles overflowing gradients itself: only a non-finite loss is a bad step.
    checked_norm = 0.0 if precision.uses_scaler else grad_norm
    finite, global_loss, stop = agree_on_step(dist, local_loss, checked_norm, stop_requested())
    if finite:
        scaler.step(optimizer)  # with fp16, skipped by the scaler itself when gradients overflowed
    scaler.update()
    if not finite:
        optimizer.zero_grad(set_to_none=True)
    num_frames = sum(float(b["feature_lens"].sum()) for b in micro_batches)
    padded = sum(b["features"].shape[0] * b["features"].shape[1] for b in micro_batches)
    return StepResult(
        loss=global_loss / max(step_tokens, 1),
        grad_norm=grad_norm,
        finite=finite,
        stop=stop,
        num_utterances=sum(len(b["cut_ids"]) for b in micro_batches),
        audio_seconds=sum(float(b["durations"].sum()) for b in micro_batches),
        padding_ratio=1.0 - num_frames / max(padded, 1),
    )
