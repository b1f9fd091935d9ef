"""Relative-position self-attention against the Transformer-XL formula written out, position by position."""

from __future__ import annotations

import math

import pytest
import torch

from asrflow.model.positions import RelPositionAttention, sinusoids

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def written_out(attention: RelPositionAttention, x: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
    """The score of query i against key j per head, ``((q_i + u) . k_j + (q_i + v) . p_{i-j}) / sqrt(d_head)``,
    with ``p_r`` the projected sinusoid of the distance ``r`` itself (no shifting of a score table); padded keys
    left out of the softmax. ``x`` (N, T, D) -> (N, T, D)."""
    n, t, d = x.shape
    query, key, value = (attention.heads(layer(x)) for layer in (attention.query, attention.key, attention.value))
    distances = torch.arange(t).view(t, 1) - torch.arange(t).view(1, t)  # (T, T): i - j
    projected = attention.position(sinusoids(distances.flatten(), d).to(x.dtype))  # (T * T, D)
    p = projected.view(t, t, attention.num_heads, attention.head_dim).permute(2, 0, 1, 3)  # (H, T, T, d_head)
    u, v = attention.content_bias.view(1, -1, 1, attention.head_dim), attention.position_bias
    content = (query + u) @ key.transpose(-2, -1)  # (N, H, T, T)
    by_position = torch.einsum("nhid,hijd->nhij", query + v.view(1, -1, 1, attention.head_dim), p)
    scores = (content + by_position) / math.sqrt(attention.head_dim)
    weights = scores.masked_fill(padding_mask.view(n, 1, 1, t), -math.inf).softmax(dim=-1)
    return attention.out((weights @ value).transpose(1, 2).reshape(n, t, d))


@pytest.mark.parametrize("device", DEVICES)
def test_rel_pos_attention_is_the_written_out_formula_forward_and_backward(device):
    torch.manual_seed(0)
    attention = RelPositionAttention(d_model=16, num_heads=4, dropout=0.0).double().to(device)
    x = torch.randn(3, 11, 16, dtype=torch.float64, device=device, requires_grad=True)
    padding_mask = torch.arange(11, device=device).view(1, 11) >= torch.tensor([11, 7, 2], device=device).view(3, 1)
    grad = torch.randn(3, 11, 16, dtype=torch.float64, device=device).masked_fill(padding_mask.unsqueeze(-1), 0.0)
    leaves = [x, *attention.parameters()]
    ours = attention(x, padding_mask)
    reference = written_out(attention, x, padding_mask)
    valid = ~padding_mask
    assert torch.allclose(ours[valid], reference[valid], atol=1e-10)
    expected = torch.autograd.grad(reference, leaves, grad)
    for got, want in zip(torch.autograd.grad(ours, leaves, grad), expected, strict=True):
        assert torch.allclose(got, want, atol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
def test_rel_pos_attention_runs_under_bf16_autocast(device):
    torch.manual_seed(0)
    attention = RelPositionAttention(d_model=16, num_heads=4, dropout=0.0).to(device)
    x = torch.randn(2, 9, 16, device=device)
    padding_mask = torch.zeros(2, 9, dtype=torch.bool, device=device)
    padding_mask[1, 5:] = True
    with torch.autocast(device, dtype=torch.bfloat16):
        mixed = attention(x, padding_mask)
    mixed.float().sum().backward()
    assert torch.isfinite(mixed.float()).all()
    assert torch.allclose(mixed.float(), attention(x, padding_mask), atol=0.1)
    assert all(torch.isfinite(p.grad).all() for p in attention.parameters())
