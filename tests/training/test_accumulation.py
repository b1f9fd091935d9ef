"""Gradient accumulation: ``accum_grad`` micro-batches give the gradients of one big batch.

``train_step`` normalises by the target tokens of the whole optimizer step, so two
micro-batches of two utterances must give what one batch of all four gives. The
utterances have different lengths and each micro-batch is cut to its longest one, so
the same utterance is padded differently in the big batch and in a micro-batch (the
model masks padding everywhere, so this must not matter); fp32, dropout off.
Tolerance: ``atol=1e-6``, ``rtol=1e-5`` on every gradient (float32 sums in another order).
"""

from __future__ import annotations

import copy

import pytest
import torch

from asrflow.model.conformer_ctc import ModelConfig, build_model
from asrflow.training.distributed import DistInfo
from asrflow.training.precision import resolve_precision
from asrflow.training.step import StepContext, ctc_loss_sum, train_step

NUM_UTTERANCES, FRAMES, MEL_BINS, TOKENS, VOCAB = 4, 120, 80, 9, 8
LENGTHS = (120, 110, 90, 70)
ATOL, RTOL = 1e-6, 1e-5


def _utterances() -> dict:
    """Four utterances of 120, 110, 90 and 70 frames: (N, T, F) features, (N, U) targets without blanks."""
    generator = torch.Generator().manual_seed(0)
    return {
        "features": torch.randn(NUM_UTTERANCES, FRAMES, MEL_BINS, generator=generator),  # (N, T, F)
        "feature_lens": torch.tensor(LENGTHS, dtype=torch.int64),
        "targets": torch.randint(1, VOCAB, (NUM_UTTERANCES, TOKENS), generator=generator),  # (N, U)
        "target_lens": torch.full((NUM_UTTERANCES,), TOKENS, dtype=torch.int64),
        "cut_ids": [f"utt{n}" for n in range(NUM_UTTERANCES)],
        "durations": torch.tensor(LENGTHS, dtype=torch.float64) / 100,
    }


def _split(batch: dict, pieces: int) -> list[dict]:
    """``pieces`` micro-batches, each padded only to its own longest utterance (as the collator does)."""
    size = NUM_UTTERANCES // pieces
    micro_batches = []
    for i in range(pieces):
        part = {key: value[i * size : (i + 1) * size] for key, value in batch.items()}
        part["features"] = part["features"][:, : int(part["feature_lens"].max())]
        micro_batches.append(part)
    return micro_batches


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    config = ModelConfig(
        input_dim=MEL_BINS,
        vocab_size=VOCAB,
        d_model=32,
        num_heads=2,
        ffn_dim=64,
        num_layers=1,
        conv_kernel_size=7,
        dropout=0.0,
    )
    return build_model(config).train()


def _step(model: torch.nn.Module, micro_batches: list[dict], lr: float):
    """One ``train_step`` (fp32, one process, no clipping in effect); returns the result."""
    precision = resolve_precision("fp32", "cpu", None)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    tokens = NUM_UTTERANCES * TOKENS
    return train_step(
        model,
        micro_batches,
        StepContext(
            optimizer=optimizer,
            scaler=precision.grad_scaler(),
            precision=precision,
            max_grad_norm=1e9,
            dist=DistInfo(),
            device=torch.device("cpu"),
        ),
        step_tokens=tokens,
    )


def test_two_micro_batches_give_the_gradients_of_one_batch():
    batch = _utterances()
    whole, accumulated = _model(), _model()
    # lr 0: the step leaves the parameters alone and the gradients in place to compare.
    one = _step(whole, [batch], lr=0.0)
    two = _step(accumulated, _split(batch, 2), lr=0.0)

    assert one.finite and two.finite
    assert two.num_utterances == one.num_utterances == NUM_UTTERANCES
    assert two.loss == pytest.approx(one.loss, rel=1e-6)
    assert two.grad_norm == pytest.approx(one.grad_norm, rel=1e-5)
    compared = 0
    for (name, p1), (_, p2) in zip(whole.named_parameters(), accumulated.named_parameters(), strict=True):
        assert p1.grad is not None and p2.grad is not None, name
        torch.testing.assert_close(p2.grad, p1.grad, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")
        compared += 1
    assert compared > 10
    assert any(p.grad.abs().max() > 1e-3 for p in whole.parameters())  # not trivially zero


def test_loss_is_normalised_by_the_tokens_of_the_whole_step():
    """The logged loss is nats per target token of the step; the gradient is that of this mean."""
    batch = _utterances()
    model = _model()
    reference = copy.deepcopy(model)
    result = _step(model, _split(batch, 4), lr=0.0)  # four micro-batches of one utterance

    log_probs, out_lens = reference(batch["features"], batch["feature_lens"])
    mean = ctc_loss_sum(log_probs, out_lens, batch) / (NUM_UTTERANCES * TOKENS)
    mean.backward()
    assert result.loss == pytest.approx(float(mean), rel=1e-6)
    for (name, p1), (_, p2) in zip(reference.named_parameters(), model.named_parameters(), strict=True):
        torch.testing.assert_close(p2.grad, p1.grad, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")


def test_accumulated_update_equals_the_big_batch_update():
    """With a real update (SGD) the parameters after the step agree as well."""
    batch = _utterances()
    whole, accumulated = _model(), _model()
    _step(whole, [batch], lr=0.1)
    _step(accumulated, _split(batch, 2), lr=0.1)
    for (name, p1), (_, p2) in zip(whole.named_parameters(), accumulated.named_parameters(), strict=True):
        torch.testing.assert_close(p2, p1, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")
