"""Comparing a resumed training run with an uninterrupted one, tensor for tensor and float for float.

A run interrupted (SIGKILL, SIGTERM) and resumed by running the same command again must end exactly
where the uninterrupted run ends: :func:`final_state` reads what a finished run leaves in its ``exp``
folder, :func:`assert_identical` compares two of them, :func:`resumed_from` reads the step a run's log
says it resumed from. :data:`OVERRIDES` is a schedule that checkpoints often, with data workers forked
from a forkserver (the default).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch

from asrflow.training.checkpoint import list_checkpoints, load_checkpoint

#: 3 epochs of 9 steps on yesno, a checkpoint every 2 steps, dev loss every 4, two data workers (forkserver).
OVERRIDES = {
    "train.optim.epochs": 3,
    "train.checkpoint.checkpoint_every_steps": 2,
    "train.checkpoint.validate_every_steps": 4,
    "train.checkpoint.keep_last": 50,
    "train.optim.average_last": 1,
    "run.num_workers": 2,
    "run.mp_start_method": "forkserver",
}


def final_state(exp: Path) -> dict:
    """The model bundle's weights, the last checkpoint (model, optimizer, progress) and the loss CSV of the
    finished run in ``exp``."""
    bundle = torch.load(exp / "model.pt", map_location="cpu", weights_only=True)
    last = load_checkpoint(list_checkpoints(exp / "checkpoints")[0])
    assert last["complete"], f"the last checkpoint in {exp} is not the end of training"
    return {"bundle": bundle["model"], "checkpoint": last, "loss_csv": (exp / "plots" / "train_loss.csv").read_text()}


def tensors(value, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside nested dicts/lists, with a path naming it."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from tensors(item, f"{prefix}.{key}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from tensors(item, f"{prefix}[{index}]")


def assert_identical(resumed: dict, reference: dict) -> None:
    """Two :func:`final_state` results are the same run: every weight, optimizer, scheduler and RNG tensor
    ``torch.equal``, the same per-step loss and grad-norm series float for float, the same loss CSV."""
    ref_ckpt, new_ckpt = reference["checkpoint"], resumed["checkpoint"]
    assert resumed["bundle"].keys() == reference["bundle"].keys()
    for name, tensor in reference["bundle"].items():
        assert torch.equal(resumed["bundle"][name], tensor), f"model weight {name} differs"
    for part in ("model", "optimizer", "scheduler", "rng"):
        ref_tensors = dict(tensors(ref_ckpt[part], part))
        new_tensors = dict(tensors(new_ckpt[part], part))
        assert new_tensors.keys() == ref_tensors.keys()
        for name, tensor in ref_tensors.items():
            assert torch.equal(new_tensors[name], tensor), f"{name} differs"
    assert new_ckpt["scheduler"] == ref_ckpt["scheduler"]
    assert new_ckpt["optimizer"]["param_groups"] == ref_ckpt["optimizer"]["param_groups"]
    assert new_ckpt["rng"]["python"] == ref_ckpt["rng"]["python"]
    ref_history, new_history = ref_ckpt["history"], new_ckpt["history"]
    assert new_history["step"] == ref_history["step"] == list(range(1, len(ref_history["step"]) + 1))
    assert new_history["loss"] == ref_history["loss"]  # exact float equality, step by step
    assert new_history["grad_norm"] == ref_history["grad_norm"]
    assert resumed["loss_csv"] == reference["loss_csv"]


def resumed_from(log: str) -> int:
    """The step a training log says the run resumed from (``resuming from <checkpoint>: step N``)."""
    match = re.search(r"resuming from \S+: step (\d+)", log)
    assert match, f"the run did not resume:\n{log}"
    return int(match.group(1))
