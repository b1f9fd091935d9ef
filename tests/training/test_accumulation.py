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

from asrflow.training.distributed import DistInfo
from asrflow.training.precision import resolve_precision
from asrflow.training.step import StepContext, ctc_loss_sum, train_step
from tests.support.step_batches import NUM_UTTERANCES, TOKENS, small_model, split_batch, utterances

ATOL, RTOL = 1e-6, 1e-5


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
    batch = utterances()
    whole, accumulated = small_model(), small_model()
    # lr 0: the step leaves the parameters alone and the gradients in place to compare.
    one = _step(whole, [batch], lr=0.0)
    two = _step(accumulated, split_batch(batch, 2), lr=0.0)

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
    batch = utterances()
    model = small_model()
    reference = copy.deepcopy(model)
    result = _step(model, split_batch(batch, 4), lr=0.0)  # four micro-batches of one utterance

    log_probs, out_lens = reference(batch["features"], batch["feature_lens"])
    mean = ctc_loss_sum(log_probs, out_lens, batch) / (NUM_UTTERANCES * TOKENS)
    mean.backward()
    assert result.loss == pytest.approx(float(mean), rel=1e-6)
    for (name, p1), (_, p2) in zip(reference.named_parameters(), model.named_parameters(), strict=True):
        torch.testing.assert_close(p2.grad, p1.grad, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")


def test_accumulated_update_equals_the_big_batch_update():
    """With a real update (SGD) the parameters after the step agree as well."""
    batch = utterances()
    whole, accumulated = small_model(), small_model()
    _step(whole, [batch], lr=0.1)
    _step(accumulated, split_batch(batch, 2), lr=0.1)
    for (name, p1), (_, p2) in zip(whole.named_parameters(), accumulated.named_parameters(), strict=True):
        torch.testing.assert_close(p2, p1, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")
