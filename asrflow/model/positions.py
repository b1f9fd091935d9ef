"""Position information for the Conformer's self-attention (``train.model.attention``).

- ``rel_pos``: self-attention with relative positions, as the Conformer paper has it (Transformer-XL's
  scores: content and position terms, each with its own learned bias per head).
- ``abs_pos``: sinusoidal absolute positions added to the subsampled frames.
- ``none``: no position information but what the convolution modules carry (torchaudio's Conformer).

Both encodings depend only on a frame's place in its own utterance, so an utterance's valid outputs stay
independent of its batch and padding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

#: Accepted values of ``train.model.attention``.
ATTENTION_KINDS = ("none", "abs_pos", "rel_pos")


def sinusoids(positions: Tensor, dim: int) -> Tensor:
    """Sinusoidal encodings (len(positions), dim) of ``positions`` (P,) float: sin and cos interleaved."""
    inverse = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) * (-math.log(1e4) / dim))
    angles = positions.float().unsqueeze(1) * inverse.unsqueeze(0)  # (P, dim / 2)
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)  # (P, dim)


def add_absolute_positions(x: Tensor) -> Tensor:
    """``x`` (N, T, D) plus the sinusoidal encoding of each frame's index (0 = an utterance's first frame)."""
    frames = torch.arange(x.size(1), device=x.device)
    return x + sinusoids(frames, x.size(2)).to(x.dtype).unsqueeze(0)


def relative_shift(scores: Tensor) -> Tensor:
    """(N, H, T, 2T - 1) scores against relative positions T-1 ... -(T-1) -> (N, H, T, T) where entry
    [i, j] is the score of relative position i - j. Pads, reshapes and slices (no gather), so exports keep
    T dynamic."""
    n, h, t, width = scores.shape
    padded = nn.functional.pad(scores, (1, 0))  # (N, H, T, 2T)
    shifted = padded.view(n, h, width + 1, t)[:, :, 1:].reshape(n, h, t, width)
    return shifted[..., :t]


class RelPositionAttention(nn.Module):
    """Multi-head self-attention with relative positions (Transformer-XL, as in the Conformer paper).

    Score of query i against key j, per head: ``((q_i + u) . k_j + (q_i + v) . p_{i-j}) / sqrt(d_head)``,
    where ``p`` projects the sinusoidal encoding of the relative position and ``u``, ``v`` are learned.
    Padded keys get no weight.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.position = nn.Linear(d_model, d_model, bias=False)
        self.out = nn.Linear(d_model, d_model)
        self.content_bias = nn.Parameter(torch.zeros(num_heads, self.head_dim))  # u
        self.position_bias = nn.Parameter(torch.zeros(num_heads, self.head_dim))  # v
        nn.init.xavier_uniform_(self.content_bias)
        nn.init.xavier_uniform_(self.position_bias)
        self.dropout = nn.Dropout(dropout)

    def heads(self, x: Tensor) -> Tensor:
        """(N, T, D) -> (N, H, T, D / H)."""
        return x.view(x.size(0), x.size(1), self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor, padding_mask: Tensor) -> Tensor:
        """``x`` (N, T, D), ``padding_mask`` (N, T) True at padded frames -> (N, T, D)."""
        n, t, d = x.shape
        query = self.heads(self.query(x))  # (N, H, T, d_head)
        key, value = self.heads(self.key(x)), self.heads(self.value(x))
        distances = torch.arange(t - 1, -t, -1, device=x.device)  # (2T - 1,): T-1 ... -(T-1)
        encoded = self.position(sinusoids(distances, d).to(x.dtype))  # (2T - 1, D)
        positions = encoded.view(1, -1, self.num_heads, self.head_dim).transpose(1, 2)  # (1, H, 2T - 1, d_head)
        scale = 1 / math.sqrt(self.head_dim)
        by_position = torch.matmul(query + self.position_bias.unsqueeze(1), positions.transpose(-2, -1))
        # The position scores enter as an additive mask, so the content scores, softmax and weighted sum can run
        # in one fused kernel where the device has one (a GPU's memory-efficient attention takes a mask's gradient).
        position_scores = (relative_shift(by_position) * scale).masked_fill(padding_mask.view(n, 1, 1, t), -math.inf)
        content_query = (query + self.content_bias.unsqueeze(1)).to(key.dtype)  # autocast: the bias is fp32
        dropout = self.dropout.p if self.training else 0.0
        mixed = nn.functional.scaled_dot_product_attention(
            content_query, key, value, attn_mask=position_scores.to(key.dtype), dropout_p=dropout, scale=scale
        )  # (N, H, T, d_head)
        return self.out(mixed.transpose(1, 2).reshape(n, t, d))
