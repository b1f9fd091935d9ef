"""Capturing and restoring every random generator training draws from.

The states are kept as tensors, lists and numbers only, so a checkpoint holding them
loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng_state() -> dict:
    """All generator states, in weights-only-loadable types."""
    version, internal, gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=False)
    return {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_state(state: dict) -> None:
    """Put every generator back where :func:`capture_rng_state` found it."""
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    numpy = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": numpy["bit_generator"],
            "state": {"key": numpy["key"].numpy().astype(np.uint32), "pos": numpy["pos"]},
            "has_gauss": numpy["has_gauss"],
            "gauss": numpy["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
