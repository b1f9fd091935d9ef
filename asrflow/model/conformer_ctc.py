"""Conformer-CTC acoustic model: convolutional subsampling by 4, a Conformer encoder, a CTC head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchaudio.models import Conformer

from asrflow.tokenizer import BLANK_ID

#: Parameter-name prefix of the CTC head (``ConformerCtc.head``); every other parameter is the encoder's.
HEAD_PREFIX = "head."


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the model; every field changes the parameters, so all are fingerprinted."""

    input_dim: int
    vocab_size: int
    d_model: int = 144
    num_heads: int = 4
    ffn_dim: int = 576
    num_layers: int = 2
    conv_kernel_size: int = 15
    dropout: float = 0.1
    #: Dropout of the attention weights (``dropout`` covers the rest). Above 0, PyTorch's attention
    #: on the CPU leaves its fused kernel for one that keeps (N, heads, T', T') tensors for the
    #: backward: at 8 layers and 8 x 15 s batches, 460 MB more memory and 1.25x the step time
    #: (bench/RESULTS.md, "Training memory against SpeechBrain"). It has no parameters, so bundles
    #: written before this field load unchanged.
    attention_dropout: float = 0.0
    #: Output channels of the two subsampling convolutions; None = (d_model, d_model), what
    #: bundles written before this field had. Narrower is much cheaper: (64, 32) is a ninth
    #: of (144, 144)'s front-end FLOPs (bench/RESULTS.md, peer_speed).
    subsampling_channels: tuple[int, int] | None = None
    #: LayerNorm over each frame's (channels x frequency) after each subsampling convolution;
    #: False (no norm) is what bundles written before this field had. A narrow front end
    #: trains badly without it.
    subsampling_norm: bool = False
    #: Initial bias of the CTC head's blank logit; None = PyTorch's default draw, what
    #: bundles written before this field had. Drawn like the others, the blank starts no
    #: likelier than a word piece, and on a small corpus training can settle on emitting one
    #: piece over the whole of the speech: yesno stayed there at 3 of the 4 seeds tried. A blank that
    #: starts likelier (3.0: e^3 = 20 times any other class) makes the outputs peaky from
    #: the first steps (bench/yesno_seeds).
    blank_bias_init: float | None = None

    def __post_init__(self) -> None:
        channels = self.subsampling_channels or (self.d_model, self.d_model)
        object.__setattr__(self, "subsampling_channels", tuple(int(c) for c in channels))


def subsampled_lengths(lengths: Tensor) -> Tensor:
    """Frames left after :class:`Conv2dSubsampling` for input ``lengths`` (N,) in frames."""
    return ((lengths - 1) // 2 - 1) // 2


class Conv2dSubsampling(nn.Module):
    """Two 3x3 convolutions with stride 2, then a linear projection: (N, T, F) -> (N, T', d_model).

    T' = ((T-1)//2-1)//2. ``channels`` are the two convolutions' output channels (default
    ``(d_model, d_model)``). The second convolution dominates the cost: per output frame it
    takes ``9 * c1 * c2 * F'`` multiply-adds (F' = ((F-1)//2-1)//2, 19 for 80 mel bins).
    With ``norm``, each convolution's output is normalised per frame over its channels and
    frequencies (:class:`ConvFrameNorm`) before the ReLU. Every output frame depends only on
    input frames inside its own 7-frame window, so an utterance's valid output frames never
    see padding.
    """

    def __init__(self, input_dim: int, d_model: int, channels: tuple[int, int] | None = None, *, norm: bool = False):
        super().__init__()
        first, second = channels or (d_model, d_model)
        half = (input_dim - 1) // 2
        freq = (half - 1) // 2
        layers: list[nn.Module] = [nn.Conv2d(1, first, kernel_size=3, stride=2)]
        if norm:
            layers.append(ConvFrameNorm(first, half))
        layers += [nn.ReLU(), nn.Conv2d(first, second, kernel_size=3, stride=2)]
        if norm:
            layers.append(ConvFrameNorm(second, freq))
        layers.append(nn.ReLU())
        self.conv = nn.Sequential(*layers)
        self.out = nn.Linear(second * freq, d_model)

    def forward(self, features: Tensor) -> Tensor:
        x = self.conv(features.unsqueeze(1))  # (N, C, T', F')
        n, c, t, f = x.shape
        return self.out(x.transpose(1, 2).reshape(n, t, c * f))  # (N, T', d_model)


class ConvFrameNorm(nn.Module):
    """LayerNorm over (channels, frequency) for each time frame of a (N, C, T, F) tensor."""

    def __init__(self, channels: int, freq: int):
        super().__init__()
        self.norm = nn.LayerNorm((channels, freq))

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x.transpose(1, 2)).transpose(1, 2)  # (N, C, T, F)


class FrameLayerNorm(nn.Module):
    """LayerNorm over channels for each frame of a (N, C, T) tensor."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = nn.LayerNorm(channels)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x.transpose(1, 2)).transpose(1, 2)  # (N, C, T)


class MaskedConvolution(nn.Module):
    """torchaudio's Conformer convolution module, with padded frames zeroed before its depthwise convolution.

    Its order is LayerNorm, pointwise conv, GLU, depthwise conv, norm, activation, pointwise
    conv, dropout. Everything but the depthwise convolution works frame by frame, so
    zeroing the padded frames right before it makes each utterance's valid frames exactly
    what they would be unpadded (where the convolution pads with zeros itself). The norm is
    :class:`FrameLayerNorm`: BatchNorm's batch statistics, or GroupNorm's over all frames,
    would mix in the padding. The frame-wise steps run on (N, T, D) with the pointwise
    convolutions as matrix products (the same function; only the depthwise convolution
    needs channels first), which saves four transposes per layer. Keeps torchaudio's
    parameter names (``layer_norm``, ``sequential.<i>``).
    """

    def __init__(self, conv_module: nn.Module, channels: int):
        super().__init__()
        self.layer_norm = conv_module.layer_norm
        self.sequential = conv_module.sequential
        kinds = [type(m) for m in self.sequential]
        if kinds[:3] != [nn.Conv1d, nn.GLU, nn.Conv1d] or kinds[5] is not nn.Conv1d or len(kinds) != 7:
            raise ValueError(f"unexpected torchaudio convolution module layout: {[k.__name__ for k in kinds]}")
        if not isinstance(self.sequential[3], FrameLayerNorm):
            self.sequential[3] = FrameLayerNorm(channels)

    def forward(self, x: Tensor, padding_mask: Tensor) -> Tensor:
        """``x`` (N, T, D), ``padding_mask`` (N, T) True at padded frames -> (N, T, D)."""
        # sequential: 0 pointwise in, 1 GLU, 2 depthwise, 3 norm, 4 activation, 5 pointwise out, 6 dropout
        pointwise_in, pointwise_out = self.sequential[0], self.sequential[5]
        y = F.linear(self.layer_norm(x), pointwise_in.weight.squeeze(-1), pointwise_in.bias)  # (N, T, 2D)
        y = F.glu(y, dim=-1).masked_fill(padding_mask.unsqueeze(-1), 0.0)  # (N, T, D)
        y = self.sequential[2](y.transpose(1, 2)).transpose(1, 2)  # (N, T, D)
        y = self.sequential[4](self.sequential[3].norm(y))
        return self.sequential[6](F.linear(y, pointwise_out.weight.squeeze(-1), pointwise_out.bias))


class ConformerBlock(nn.Module):
    """One torchaudio Conformer layer (convolution after attention) that masks padding in attention and convolution.

    Takes over the layer's submodules under their names, so state dicts are torchaudio's.
    ``distinct_key_value`` passes key and value to the attention as tensors distinct from
    the query: the same function, but PyTorch then projects them in three matmuls instead
    of one packed one, whose time axis the ONNX exporter would freeze (see asrflow.serving.export).
    """

    def __init__(self, layer: nn.Module, channels: int, distinct_key_value: bool = False):
        super().__init__()
        if getattr(layer, "convolution_first", False):
            raise ValueError("ConformerBlock supports Conformer layers with the convolution after attention only")
        self.ffn1 = layer.ffn1
        self.self_attn_layer_norm = layer.self_attn_layer_norm
        self.self_attn = layer.self_attn
        self.self_attn_dropout = layer.self_attn_dropout
        conv = layer.conv_module
        self.conv_module = conv if isinstance(conv, MaskedConvolution) else MaskedConvolution(conv, channels)
        self.ffn2 = layer.ffn2
        self.final_layer_norm = layer.final_layer_norm
        self.distinct_key_value = distinct_key_value

    def forward(self, x: Tensor, padding_mask: Tensor) -> Tensor:
        """``x`` (T, N, D), ``padding_mask`` (N, T) True at padded frames -> (T, N, D)."""
        x = self.ffn1(x) * 0.5 + x
        residual = x
        query = self.self_attn_layer_norm(x)
        if self.distinct_key_value:
            key, value = query.view_as(query), query.view_as(query)
        else:
            key, value = query, query
        x, _ = self.self_attn(query, key, value, key_padding_mask=padding_mask, need_weights=False)
        x = self.self_attn_dropout(x) + residual
        x = self.conv_module(x.transpose(0, 1), padding_mask).transpose(0, 1) + x
        x = self.ffn2(x) * 0.5 + x
        return self.final_layer_norm(x)


class ConformerCtc(nn.Module):
    """Fbank frames in, per-frame log-probabilities over the vocabulary (blank = 0) out.

    An utterance's output does not depend on the batch it is in nor on its padding: every
    part of the encoder either works frame by frame or masks the padded frames.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.subsampling = Conv2dSubsampling(
            config.input_dim, config.d_model, config.subsampling_channels, norm=config.subsampling_norm
        )
        self.dropout = nn.Dropout(config.dropout)
        self.encoder = Conformer(
            input_dim=config.d_model,
            num_heads=config.num_heads,
            ffn_dim=config.ffn_dim,
            num_layers=config.num_layers,
            depthwise_conv_kernel_size=config.conv_kernel_size,
            dropout=config.dropout,
            use_group_norm=True,  # replaced by MaskedConvolution's per-frame norm
        )
        self.encoder.conformer_layers = nn.ModuleList(
            ConformerBlock(layer, config.d_model) for layer in self.encoder.conformer_layers
        )
        for block in self.encoder.conformer_layers:
            block.self_attn.dropout = config.attention_dropout  # torchaudio gives it ``dropout``
        self.head = nn.Linear(config.d_model, config.vocab_size)
        if config.blank_bias_init is not None:
            with torch.no_grad():
                self.head.bias[BLANK_ID] = config.blank_bias_init

    def forward(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """Encode a padded batch.

        Args:
            features: (N, T, F) normalised fbank, 10 ms frames.
            lengths: (N,) valid frames per utterance.

        Returns:
            log_probs: (N, T', V) log-softmax over the vocabulary, T' = ``subsampled_lengths(T)``.
            out_lengths: (N,) valid output frames (40 ms each).
        """
        x = self.dropout(self.subsampling(features))  # (N, T', D)
        # The mask is sized from x's own time axis (not from lengths.max()), so an ONNX
        # trace keeps T' dynamic.
        frames = torch.arange(x.size(1), device=lengths.device, dtype=lengths.dtype)  # (T',)
        out_lengths = torch.minimum(subsampled_lengths(lengths).clamp(min=1), frames[-1] + 1)  # (N,)
        padding_mask = frames.unsqueeze(0) >= out_lengths.unsqueeze(1)  # (N, T'), True = padding
        x = x.transpose(0, 1)  # (T', N, D)
        for layer in self.encoder.conformer_layers:
            x = layer(x, padding_mask)
        return self.output(x.transpose(0, 1)), out_lengths  # (N, T', V), (N,)

    def output(self, encoded: Tensor) -> Tensor:
        """CTC head: (N, T', D) encoder output -> (N, T', V) fp32 log-probabilities.

        Runs in fp32 whatever autocast is active: under bf16 or fp16 the log-probabilities
        would be rounded to 8 or 11 bits of mantissa, so they no longer normalise and the
        CTC loss computed from them can go negative. The projection is d_model x V per
        frame, a negligible share of the model's cost.
        """
        if torch.jit.is_scripting():  # TorchScript has no autocast to leave (and no dynamic device type)
            return self.head(encoded.float()).log_softmax(dim=-1)
        return self._output_outside_autocast(encoded)

    @torch.jit.unused
    def _output_outside_autocast(self, encoded: Tensor) -> Tensor:
        """:meth:`output` with autocast switched off (eager mode and tracing)."""
        with torch.autocast(device_type=encoded.device.type, enabled=False):
            return self.head(encoded.float()).log_softmax(dim=-1)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def build_model(config: ModelConfig) -> ConformerCtc:
    """Construct the model (parameters drawn from the current torch RNG)."""
    return ConformerCtc(config)


__all__ = ["HEAD_PREFIX", "ConformerCtc", "ModelConfig", "build_model", "count_parameters", "subsampled_lengths"]
