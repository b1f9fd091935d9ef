"""The device a model bundle decodes on (``evaluate.device``, ``asrflow transcribe --device``, the pyfunc):
``auto`` (the first CUDA GPU when there is one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``."""

from __future__ import annotations

import re

import torch

from asrflow.errors import AsrflowError

#: What a device setting may name; ``cuda:N`` picks the N-th GPU.
DEVICE_NAMES = ("auto", "cpu", "cuda", "cuda:N")
_CUDA = re.compile(r"cuda(:(\d+))?")


def is_device_name(value: object) -> bool:
    """Whether ``value`` is one of :data:`DEVICE_NAMES` (nothing is asked of the machine)."""
    return isinstance(value, str) and (value in ("auto", "cpu") or _CUDA.fullmatch(value) is not None)


def no_gpu_reason() -> str:
    """What this process finds instead of a CUDA GPU."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU build"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA GPU"


def resolve_device(requested: str, setting: str) -> torch.device:
    """The device ``requested`` names, checked against this machine; ``setting`` (e.g. ``evaluate.device``)
    is named in the :class:`AsrflowError` when it cannot be had."""
    if not is_device_name(requested):
        raise AsrflowError(f"{setting} = {requested!r} is not a device: use one of {', '.join(DEVICE_NAMES)}")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise AsrflowError(f"{setting} = {requested}, but {no_gpu_reason()}: set it to auto or cpu")
    index = int(_CUDA.fullmatch(requested).group(2) or 0)
    if index >= torch.cuda.device_count():
        found = torch.cuda.device_count()
        raise AsrflowError(
            f"{setting} = {requested}, but this machine has {found} CUDA GPU(s): use cuda:0 to cuda:{found - 1}"
        )
    return torch.device("cuda", index)
