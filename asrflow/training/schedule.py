"""The optimizer (AdamW) and its learning-rate schedule: linear warmup, then inverse square-root decay."""

from __future__ import annotations

import torch


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters, in its fused kernel (CPU and CUDA): one pass over all
    parameters instead of a loop of small ones, 0.9 ms a step against 4.7 ms for the default
    on the default model at 1 CPU thread (issue 12)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=True)


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Multiplier of the peak LR after ``step`` optimizer steps (peak 1.0 at ``warmup_steps``)."""
    step = max(step, 1)
    if warmup_steps <= 0:
        return 1.0
    return min(step / warmup_steps, (warmup_steps / step) ** 0.5)


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over :func:`warmup_factor`; its state is part of every checkpoint."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_factor(step + 1, warmup_steps))


def apply_lr_scale(scheduler: torch.optim.lr_scheduler.LambdaLR, peak_lr: float) -> None:
    """Move the schedule's peak to ``peak_lr`` (after a rollback) and set the optimizer's current lr to match."""
    scheduler.base_lrs = [peak_lr for _ in scheduler.base_lrs]
    for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = base * scheduler.lr_lambdas[0](scheduler.last_epoch)
