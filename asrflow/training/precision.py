"""Precision policy: which autocast dtype to train in, and whether a gradient scaler runs.

``auto`` picks bfloat16 autocast on CUDA devices of compute capability 8.0 or higher
(Ampere and newer have bf16 tensor cores and fp32's exponent range, so no loss scaling),
and fp32 on older GPUs (V100, T4: fp16's range of about +-65504 overflows in long runs).
On the CPU it picks fp32. Whether bf16 is faster there depends on the CPU model and the
model's shapes, not only on native bf16 instructions: oneDNN's bf16 kernels can be faster
than fp32 on one CPU with ``avx512_bf16`` and slower on another with AMX
(bench/RESULTS.md#precision-by-cpu). So the CPU's choice is measured, not guessed: ``python -m
asrflow.training.tune`` times both on the machine at hand and writes ``bf16`` into a preset
where it wins. fp16 is never automatic and always runs with a dynamic gradient scaler.

Whatever the precision, the model's CTC head (its log-softmax) and the CTC loss run in
fp32 (:meth:`asrflow.model.conformer_ctc.ConformerCtc.output`), so reduced precision never
rounds the log-probabilities the loss sees.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from asrflow.errors import AsrflowError

CHOICES = ("auto", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class PrecisionPolicy:
    """The resolved choice: ``name`` in fp32/bf16/fp16, the device type, and why."""

    name: str
    device_type: str
    reason: str

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.name)

    @property
    def uses_scaler(self) -> bool:
        return self.name == "fp16"

    def autocast(self):
        """The autocast context for forward passes (a no-op for fp32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """A scaler that is enabled only for fp16."""
        return torch.amp.GradScaler(self.device_type, enabled=self.uses_scaler)


def resolve_precision(requested: str, device_type: str, capability: tuple[int, int] | None) -> PrecisionPolicy:
    """Apply the policy.

    Args:
        requested: ``train.optim.precision`` (auto, fp32, bf16 or fp16).
        device_type: ``"cuda"`` or ``"cpu"``.
        capability: the CUDA compute capability (major, minor), or None off CUDA.
    """
    if requested not in CHOICES:
        raise AsrflowError(f"params.yaml: train.optim.precision = {requested!r}; use one of {', '.join(CHOICES)}")
    if requested != "auto":
        return PrecisionPolicy(requested, device_type, f"train.optim.precision = {requested}")
    if device_type == "cuda" and capability is not None and capability >= (8, 0):
        return PrecisionPolicy(
            "bf16", device_type, f"auto: GPU compute capability {capability[0]}.{capability[1]} >= 8.0 has bf16"
        )
    if device_type == "cuda":
        cap = f"{capability[0]}.{capability[1]}" if capability else "unknown"
        return PrecisionPolicy("fp32", device_type, f"auto: GPU compute capability {cap} < 8.0 lacks bf16")
    return PrecisionPolicy(
        "fp32", device_type, "auto: fp32 on the CPU (python -m asrflow.training.tune measures whether bf16 is faster)"
    )


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA device, else None."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def precision_change_tags(saved: str, policy: PrecisionPolicy, step: int) -> dict[str, str]:
    """When a resume trains in another precision than its checkpoint (``saved``): a warning, and the MLflow
    tags that record the change; else no tags."""
    if saved == policy.name:
        return {}
    logging.getLogger(__name__).warning(
        "the checkpoint was trained in %s, this run trains in %s (%s): the steps from %d on differ "
        "from an uninterrupted run",
        saved,
        policy.name,
        policy.reason,
        step,
    )
    return {
        "precision": policy.name,
        "precision_reason": policy.reason,
        "precision_changed": f"{saved} -> {policy.name} at step {step}",
    }


def precision_for(requested: str, device: torch.device) -> PrecisionPolicy:
    """:func:`resolve_precision` for ``device``, reading its capability (CUDA)."""
    return resolve_precision(requested, device.type, device_capability(device))
