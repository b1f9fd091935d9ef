"""Precision policy: what ``auto`` picks per device, and fp16 / bf16 training on the CPU.

The training runs use the real ``Trainer`` on the prepared yesno data (tiny model, two
epochs of nine steps). fp16 runs with its dynamic gradient scaler on the CPU: its first
steps overflow while the scale calibrates, which the scaler handles alone (skip + lower
the scale); they are not non-finite *losses*, so the guard must neither count nor roll
back for them.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from asrflow.errors import AsrflowError
from asrflow.model.conformer_ctc import build_model
from asrflow.training.checkpoint import list_checkpoints, load_checkpoint
from asrflow.training.precision import resolve_precision
from tests.support.mlflow_store import fresh_mlflow_store
from tests.support.tiny_config import tiny_model_config, tiny_trainer, train_paths


@pytest.mark.parametrize(
    ("requested", "device_type", "capability", "name", "scaler"),
    [
        ("auto", "cuda", (9, 0), "bf16", False),  # H100
        ("auto", "cuda", (8, 0), "bf16", False),  # A100
        ("auto", "cuda", (8, 6), "bf16", False),  # RTX 30xx
        ("auto", "cuda", (7, 5), "fp32", False),  # T4
        ("auto", "cuda", (7, 0), "fp32", False),  # V100
        ("auto", "cuda", (6, 1), "fp32", False),  # P40
        ("auto", "cuda", None, "fp32", False),
        ("auto", "cpu", None, "fp32", False),  # every CPU: whether bf16 wins is measured by the tuner
        ("fp32", "cuda", (9, 0), "fp32", False),
        ("bf16", "cpu", None, "bf16", False),
        ("bf16", "cuda", (7, 0), "bf16", False),  # explicit choices are obeyed
        ("fp16", "cuda", (9, 0), "fp16", True),
        ("fp16", "cuda", (7, 0), "fp16", True),
        ("fp16", "cpu", None, "fp16", True),
    ],
)
def test_resolve_precision_table(requested, device_type, capability, name, scaler):
    policy = resolve_precision(requested, device_type, capability)
    assert policy.name == name
    assert policy.device_type == device_type
    assert policy.uses_scaler is scaler
    if device_type == "cpu" or torch.cuda.is_available():  # a CUDA scaler disables itself without a GPU
        assert policy.grad_scaler().is_enabled() is scaler
    assert policy.autocast_dtype == {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
    assert policy.reason  # logged and tagged in MLflow: says why
    if requested == "auto":
        assert policy.reason.startswith("auto")
    if requested == "auto" and device_type == "cpu":
        assert "asrflow.training.tune" in policy.reason  # says how to find out whether bf16 is faster


def test_the_trainer_resolves_auto_to_fp32_on_the_cpu(yesno_data, tmp_path):
    """``auto`` trains in fp32 on every CPU, whatever its bf16 instructions (the tuner measures bf16)."""
    overrides = {"train.optim.precision": "auto", "train.optim.epochs": 1, "train.checkpoint.validate_every_steps": 0}
    summary = tiny_trainer(yesno_data, tmp_path, overrides, tracking_uri=fresh_mlflow_store(tmp_path)).run().summary
    assert summary["precision"] == "fp32"


@pytest.mark.parametrize("bad", ["fp64", "AUTO", "", "float16"])
def test_resolve_precision_rejects_unknown_values(bad):
    with pytest.raises(AsrflowError, match=r"train\.optim\.precision.*auto, fp32, bf16, fp16"):
        resolve_precision(bad, "cpu", None)


def test_autocast_dtype_reaches_the_model_on_cpu():
    layer = torch.nn.Linear(4, 4)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        with resolve_precision(name, "cpu", None).autocast():
            assert layer(torch.ones(2, 4)).dtype == dtype


def _losses(exp: Path) -> list[float]:
    with open(exp / "plots" / "train_loss.csv") as handle:
        return [float(row["loss"]) for row in csv.DictReader(handle)]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_trains_on_cpu(yesno_data, tmp_path, precision):
    """A few steps train with finite, decreasing losses; fp16 runs (and saves) its GradScaler.

    ``max_consecutive_nonfinite: 2`` is below the number of overflowing steps fp16's
    scaler needs to calibrate from its initial scale of 2**16 here, so counting those as
    non-finite steps would roll back (and, the scaler state rolling back too, stop).
    """
    overrides = {
        "train.optim.precision": precision,
        # drawn: the loss starts far above the plateau, so 18 steps show a clear drop
        "train.model.blank_bias_init": None,
        "train.optim.epochs": 2,
        "train.checkpoint.checkpoint_every_steps": 100,
        "train.checkpoint.validate_every_steps": 0,
        "train.nonfinite.max_consecutive_nonfinite": 2,
    }
    paths = train_paths(yesno_data, tmp_path)
    trainer = tiny_trainer(yesno_data, tmp_path, overrides, seed=42, tracking_uri=fresh_mlflow_store(tmp_path))
    summary = trainer.run().summary

    assert summary["precision"] == precision
    assert summary["steps"] == 18
    assert summary["rollbacks"] == 0
    assert summary["nonfinite_skipped"] == 0
    assert not paths.bad_batches.exists()
    losses = _losses(tmp_path)
    assert len(losses) == 18 and all(math.isfinite(loss) for loss in losses), losses
    # CTC on yesno: ~6.6 nats/token at the start, the blank plateau (~1.9) within a few steps.
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3, losses
    assert losses[-1] < losses[0]

    last = load_checkpoint(list_checkpoints(paths.checkpoint_dir)[0])
    assert all(torch.isfinite(value).all() for value in last["model"].values() if value.is_floating_point())
    if precision == "fp16":
        scale = last["scaler"]["scale"]
        assert 0 < scale < 2.0**16  # calibrated down from the initial scale on overflowing steps
    else:
        assert last["scaler"] == {}  # bf16 has fp32's range: no loss scaling


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ctc_head_and_loss_stay_fp32_under_autocast(dtype):
    """The head's log-softmax and the CTC loss are fp32 under bf16/fp16 autocast (issue 12, item 7).

    Rounded to bf16 the log-probabilities no longer normalise, and the loss of a
    confidently right utterance went negative. Per-utterance losses must be >= 0 and
    within 1e-3 of fp32 on the same encoder output.
    """
    import torch.nn.functional as F

    from asrflow.tokenizer import BLANK_ID

    torch.manual_seed(0)
    model = build_model(tiny_model_config(), input_dim=80, vocab_size=13)
    with torch.no_grad():  # a confident head: near-zero losses are the ones rounding makes negative
        model.head.weight.mul_(40.0)
    encoded = torch.randn(3, 50, 32)  # (N, T', D)
    greedy = model.output(encoded).argmax(-1)  # (N, T') the path the model believes
    targets = [torch.unique_consecutive(row)[torch.unique_consecutive(row) != BLANK_ID] for row in greedy]
    lengths = torch.tensor([len(t) for t in targets])
    flat = torch.cat(targets)
    out_lens = torch.full((3,), 50)

    def losses(log_probs):
        assert log_probs.dtype == torch.float32
        return F.ctc_loss(log_probs.transpose(0, 1), flat, out_lens, lengths, blank=BLANK_ID, reduction="none")

    reference = losses(model.output(encoded))
    with torch.autocast(device_type="cpu", dtype=dtype):
        mixed = losses(model.output(encoded))
        assert torch.nn.Linear(4, 4)(torch.ones(1, 4)).dtype == dtype  # autocast is really on
    assert (mixed >= 0).all(), mixed
    assert torch.allclose(mixed, reference, atol=1e-3, rtol=0), (mixed, reference)
    # the rounding this guards against: bf16/fp16 log-probabilities, as before the fix
    rounded = losses(model.output(encoded).to(dtype).float())
    assert not torch.allclose(rounded, reference, atol=1e-6, rtol=0)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_model_forward_returns_fp32_log_probs_under_autocast(precision):
    torch.manual_seed(0)
    model = build_model(tiny_model_config(), input_dim=80, vocab_size=13)
    features = torch.randn(2, 120, 80)
    with resolve_precision(precision, "cpu", None).autocast():
        log_probs, _ = model(features, torch.tensor([120, 90]))
    assert log_probs.dtype == torch.float32
    assert torch.allclose(log_probs.exp().sum(-1), torch.ones(2, log_probs.shape[1]), atol=1e-5)
