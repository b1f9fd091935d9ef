"""Checkpoints: atomic writes, pruning, the best link, unreadable files, safe loading, RNG state."""

from __future__ import annotations

import logging
import os
import pickle
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from asrflow.training import checkpoint as ckpt
from asrflow.training.run_state import capture_rng_state, restore_rng_state, seed_everything
from tests.support.mlflow_store import fresh_mlflow_store
from tests.support.train_entry import train_in_process


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((3, 2), value), "step_count": torch.tensor(int(value))}, "complete": False}


def _names(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


# ---------------------------------------------------------------------- saving


def test_save_is_atomic_and_leaves_no_temporary_files(tmp_path):
    path = ckpt.save_checkpoint(_state(1.0), tmp_path, 7, keep_last=3, is_best=False)
    assert path == tmp_path / "step-00000007.pt"
    assert _names(tmp_path) == ["step-00000007.pt"]
    loaded = ckpt.load_checkpoint(path)
    assert loaded["step"] == 7 and loaded["format"] == ckpt.FORMAT_VERSION
    assert torch.equal(loaded["model"]["w"], torch.full((3, 2), 1.0))
    # Saving the same step again replaces the file in one rename.
    ckpt.save_checkpoint(_state(2.0), tmp_path, 7, keep_last=3, is_best=True)
    assert _names(tmp_path) == ["best.pt", "step-00000007.pt"]
    assert torch.equal(ckpt.load_checkpoint(path)["model"]["w"], torch.full((3, 2), 2.0))


def test_a_failed_save_leaves_the_previous_checkpoints_and_no_temporary_file(tmp_path):
    ckpt.save_checkpoint(_state(1.0), tmp_path, 2, keep_last=3, is_best=False)
    before = (tmp_path / "step-00000002.pt").read_bytes()
    unpicklable = {**_state(2.0), "callback": lambda: None}
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        ckpt.save_checkpoint(unpicklable, tmp_path, 4, keep_last=3, is_best=False)
    assert _names(tmp_path) == ["step-00000002.pt"]
    assert (tmp_path / "step-00000002.pt").read_bytes() == before
    assert ckpt.load_latest(tmp_path)[1] == tmp_path / "step-00000002.pt"


def test_keep_last_never_prunes_the_protected_rollback_target(tmp_path):
    """Checkpoints 4 and 5 taken inside a streak of non-finite steps: step 3 (the last good one) stays."""
    for step in (1, 2, 3):
        ckpt.save_checkpoint(_state(float(step)), tmp_path, step, keep_last=2, is_best=False, protect=step)
    assert _names(tmp_path) == ["step-00000002.pt", "step-00000003.pt"]
    for step in (4, 5):
        ckpt.save_checkpoint(_state(float(step)), tmp_path, step, keep_last=2, is_best=False, protect=3)
    assert _names(tmp_path) == ["step-00000003.pt", "step-00000004.pt", "step-00000005.pt"]
    ckpt.save_checkpoint(_state(6.0), tmp_path, 6, keep_last=2, is_best=False, protect=6)
    assert _names(tmp_path) == ["step-00000005.pt", "step-00000006.pt"]


def test_keep_last_prunes_old_checkpoints_and_best_survives_as_a_hard_link(tmp_path):
    ckpt.save_checkpoint(_state(1.0), tmp_path, 1, keep_last=2, is_best=False)
    ckpt.save_checkpoint(_state(2.0), tmp_path, 2, keep_last=2, is_best=True)
    best, step2 = tmp_path / ckpt.BEST, tmp_path / "step-00000002.pt"
    assert os.stat(best).st_ino == os.stat(step2).st_ino  # a hard link, not a copy
    assert os.stat(step2).st_nlink == 2
    for step in (3, 4, 5):
        ckpt.save_checkpoint(_state(float(step)), tmp_path, step, keep_last=2, is_best=False)
    assert _names(tmp_path) == ["best.pt", "step-00000004.pt", "step-00000005.pt"]
    assert [path.name for path in ckpt.list_checkpoints(tmp_path)] == ["step-00000005.pt", "step-00000004.pt"]
    # step 2 was pruned, but the best checkpoint's data is still there through the link
    kept = ckpt.load_checkpoint(best)
    assert kept["step"] == 2 and torch.equal(kept["model"]["w"], torch.full((3, 2), 2.0))
    assert os.stat(best).st_nlink == 1
    # a new best moves the link
    ckpt.save_checkpoint(_state(6.0), tmp_path, 6, keep_last=2, is_best=True)
    assert os.stat(best).st_ino == os.stat(tmp_path / "step-00000006.pt").st_ino
    assert ckpt.load_checkpoint(best)["step"] == 6
    assert _names(tmp_path) == ["best.pt", "step-00000005.pt", "step-00000006.pt"]
    ckpt.remove_checkpoints(tmp_path)
    assert _names(tmp_path) == []


def test_average_of_model_states(tmp_path):
    paths = [ckpt.save_checkpoint(_state(float(v)), tmp_path, v, keep_last=5, is_best=False) for v in (1, 2, 6)]
    averaged = ckpt.average_model_states(paths)
    assert torch.equal(averaged["w"], torch.full((3, 2), 3.0))
    assert torch.equal(averaged["step_count"], torch.tensor(1))  # integers come from the first


# ---------------------------------------------------------------------- unreadable checkpoints


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "not_asrflow"])
def test_unreadable_newest_checkpoint_is_skipped_with_a_warning(tmp_path, caplog, damage):
    for step in (2, 4, 6):
        ckpt.save_checkpoint(_state(float(step)), tmp_path, step, keep_last=5, is_best=False)
    newest = tmp_path / "step-00000006.pt"
    data = newest.read_bytes()
    if damage == "truncated":
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        newest.write_bytes(b"")
    elif damage == "garbage":
        newest.write_bytes(os.urandom(len(data)))
    else:  # a readable torch file that is not an asrflow checkpoint
        torch.save({"weights": torch.zeros(2)}, newest)
    with caplog.at_level(logging.WARNING, logger="asrflow.training.checkpoint"):
        state, path = ckpt.load_latest(tmp_path)
    assert path == tmp_path / "step-00000004.pt"
    assert state["step"] == 4 and torch.equal(state["model"]["w"], torch.full((3, 2), 4.0))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "step-00000006.pt is unreadable" in warnings[0]
    assert "falling back to the previous one" in warnings[0]


def test_a_flipped_bit_in_tensor_data_is_caught_by_the_digest(tmp_path, caplog):
    for step in (2, 4):
        ckpt.save_checkpoint(_state(float(step)), tmp_path, step, keep_last=5, is_best=False)
    newest = tmp_path / "step-00000004.pt"
    data = bytearray(newest.read_bytes())
    weights = struct.pack("<6f", *[4.0] * 6)  # model.w, stored raw inside the zip
    assert data.count(weights) == 1
    data[data.index(weights) + 2] ^= 0x01  # 4.0 becomes 4.0000305
    newest.write_bytes(bytes(data))
    # torch itself loads the damaged file without a word
    silently = torch.load(newest, weights_only=True)
    assert not torch.equal(silently["model"]["w"], torch.full((3, 2), 4.0))
    with pytest.raises(ValueError, match="does not match the digest"):
        ckpt.load_checkpoint(newest)
    with caplog.at_level(logging.WARNING, logger="asrflow.training.checkpoint"):
        state, path = ckpt.load_latest(tmp_path)
    assert path == tmp_path / "step-00000002.pt" and state["step"] == 2
    assert any("step-00000004.pt is unreadable" in r.getMessage() for r in caplog.records)


def test_the_digest_covers_every_kind_of_value_and_survives_a_round_trip(tmp_path):
    state = {
        "model": {"w": torch.arange(6.0).reshape(2, 3).t(), "h": torch.ones(2, dtype=torch.bfloat16)},
        "optimizer": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.98), "foreach": None}]},
        "progress": {"history": [1.5, float("nan")], "epoch": 3},
        "complete": True,
    }
    path = ckpt.save_checkpoint(state, tmp_path, 1, keep_last=1, is_best=False)
    loaded = ckpt.load_checkpoint(path)  # raises on a mismatch
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    base = ckpt.content_digest(state)
    for changed in (
        {**state, "complete": False},
        {**state, "model": {**state["model"], "w": state["model"]["w"].t()}},
        {**state, "progress": {"history": [1.5, float("nan")], "epoch": 4}},
    ):
        assert ckpt.content_digest(changed) != base


def test_no_readable_checkpoint_means_none(tmp_path):
    assert ckpt.load_latest(tmp_path / "missing") is None
    (tmp_path / "step-00000001.pt").write_bytes(b"\0" * 10)
    assert ckpt.load_latest(tmp_path) is None


@pytest.mark.slow
def test_training_resumes_from_the_previous_checkpoint_when_the_newest_is_truncated(
    yesno_data, tmp_path, caplog, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    exp = tmp_path / "exp"
    uri = fresh_mlflow_store(tmp_path)
    overrides = {
        "train.optim.epochs": 1,
        "train.checkpoint.checkpoint_every_steps": 4,
        "train.checkpoint.validate_every_steps": 4,
    }
    summary = train_in_process(yesno_data, exp, overrides, uri)
    steps = summary["steps"]
    assert steps % 4, "the last step must not be a regular checkpoint step"
    directory = exp / "checkpoints"
    last = directory / f"step-{steps:08d}.pt"
    previous = directory / f"step-{steps - steps % 4:08d}.pt"
    expected = ckpt.load_checkpoint(last)
    assert expected["complete"]
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 3])  # a crash while the file system lost its tail

    with caplog.at_level(logging.INFO):
        again = train_in_process(yesno_data, exp, overrides, uri)
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"checkpoint {last} is unreadable" in m for m in messages)
    assert any(m.startswith(f"resuming from {previous}: step {steps - steps % 4}") for m in messages)
    assert again["steps"] == steps
    redone = ckpt.load_checkpoint(last)  # rewritten whole by the resumed run
    assert redone["complete"]
    for name, tensor in expected["model"].items():
        assert torch.equal(redone["model"][name], tensor), name
    assert redone["history"] == expected["history"]


# ---------------------------------------------------------------------- safe loading


class _Payload:
    """Unpickling this would run code: it creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_checkpoint_holding_a_pickled_object_is_refused_without_running_it(tmp_path, caplog):
    ckpt.save_checkpoint(_state(1.0), tmp_path, 1, keep_last=5, is_best=False)
    marker = tmp_path / "code-ran"
    evil = tmp_path / "step-00000002.pt"
    torch.save({"format": ckpt.FORMAT_VERSION, "step": 2, "model": {}, "extra": _Payload(marker)}, evil)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        ckpt.load_checkpoint(evil)
    assert not marker.exists()
    with caplog.at_level(logging.WARNING, logger="asrflow.training.checkpoint"):
        state, path = ckpt.load_latest(tmp_path)
    assert path.name == "step-00000001.pt" and state["step"] == 1
    assert not marker.exists()
    assert any("step-00000002.pt is unreadable" in r.getMessage() for r in caplog.records)
    # the same file does run code when loaded unsafely: the refusal above is what protects
    torch.load(evil, weights_only=False)
    assert marker.exists()


# ---------------------------------------------------------------------- RNG state


def _draws() -> tuple:
    return (
        [random.random() for _ in range(3)],
        random.gauss(0.0, 1.0),
        np.random.rand(3).tolist(),
        float(np.random.normal()),
        torch.rand(4),
        torch.nn.functional.dropout(torch.ones(16), 0.5, training=True),
    )


def test_rng_state_round_trip_through_a_checkpoint(tmp_path):
    seed_everything(1234)
    _draws()
    # leave cached Gaussians behind: Python's gauss_next and NumPy's has_gauss
    random.gauss(0.0, 1.0)
    np.random.normal()
    ckpt.save_checkpoint({"rng": capture_rng_state()}, tmp_path, 1, keep_last=1, is_best=False)
    expected = _draws()
    _draws()  # move every generator on
    seed_everything(99)
    restore_rng_state(ckpt.load_checkpoint(tmp_path / "step-00000001.pt")["rng"])  # weights_only load
    again = _draws()
    assert again[:4] == expected[:4]
    assert torch.equal(again[4], expected[4]) and torch.equal(again[5], expected[5])


def test_seed_everything_is_deterministic():
    seed_everything(7)
    first = _draws()
    seed_everything(7)
    second = _draws()
    assert first[:4] == second[:4] and torch.equal(first[4], second[4])
