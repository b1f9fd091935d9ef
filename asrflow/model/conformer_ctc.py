"""Conformer-CTC acoustic model: convolutional subsampling by 4, a Conformer encoder, a CTC head."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchaudio.models import Conformer

from asrflow.model.positions import ATTENTION_KINDS, RelPositionAttention, add_absolute_positions
from asrflow.params import check_at_least, check_choice, param_error
from asrflow.tokenizer import BLANK_ID

SECTION = "train.model"

#: Parameter-name prefix of the CTC head (``ConformerCtc.head``); every other parameter is the encoder's.
HEAD_PREFIX = "head."


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """params.yaml's ``train.model`` section: the encoder's shape (each key is documented there). Every field
    changes the parameters, so all are fingerprinted. The input width (fbank bins) and the vocabulary size come
    from the data and are given to :class:`ConformerCtc` beside this section."""

    d_model: int
    num_heads: int
    ffn_dim: int
    num_layers: int
    conv_kernel_size: int
    dropout: float
    attention_dropout: float
    #: None = (d_model, d_model).
    subsampling_channels: tuple[int, int] | None
    subsampling_norm: bool
    #: None = drawn like the other biases.
    blank_bias_init: float | None
    #: Position information in self-attention, one of :data:`~asrflow.model.positions.ATTENTION_KINDS`.
    attention: str

    def __post_init__(self) -> None:
        check_at_least(self, SECTION, 1, "d_model", "num_heads", "ffn_dim", "num_layers", "conv_kernel_size")
        check_choice(self, SECTION, "attention", ATTENTION_KINDS)
        if self.d_model % self.num_heads:
            raise param_error(SECTION, "num_heads", self.num_heads, f"must divide {SECTION}.d_model ({self.d_model})")
        if self.conv_kernel_size % 2 == 0:
            raise param_error(SECTION, "conv_kernel_size", self.conv_kernel_size, "must be odd (e.g. 15)")
        channels = self.subsampling_channels
        if channels is not None and (
            len(channels) != 2 or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in channels)
        ):
            raise param_error(
                SECTION, "subsampling_channels", channels, "must be null (d_model each) or two positive integers"
            )
        for key in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise param_error(SECTION, key, getattr(self, key), "must be in [0, 1)")
        channels = channels or (self.d_model, self.d_model)
        object.__setattr__(self, "subsampling_channels", tuple(int(c) for c in channels))


#: What bundles written before a ``train.model`` key existed were built with: a saved shape without the key
#: loads with this value (the front end of d_model channels without a norm, a blank bias drawn like the others).
ADDED_LATER = {
    "attention_dropout": 0.0,
    "subsampling_channels": None,
    "subsampling_norm": False,
    "blank_bias_init": None,
    "attention": "none",
}


def shape_record(config: ModelConfig, *, input_dim: int, vocab_size: int) -> dict:
    """The model's whole shape as bundles, exports and fingerprints record it: ``config`` with the input width
    (fbank bins) and the vocabulary size (blank included)."""
    return {"input_dim": input_dim, "vocab_size": vocab_size, **asdict(config)}


def config_from_record(record: dict) -> tuple[ModelConfig, int, int]:
    """The section, input width and vocabulary size of a :func:`shape_record` (old ones included)."""
    fields = dict(ADDED_LATER) | dict(record)
    input_dim, vocab_size = fields.pop("input_dim"), fields.pop("vocab_size")
    return ModelConfig(**fields), int(input_dim), int(vocab_size)


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
    """LayerNorm over (channels, frequency) for each time frame of a (N, C, T, F) tensor.

    The norm runs over the flattened C * F values, with the (C, F) weight and bias viewed flat: the
    same normalisation as ``nn.LayerNorm((C, F))``, whose CUDA backward returns a gradient of the
    wrong shape (and writes out of bounds) for a multi-dimensional ``normalized_shape`` once there
    are more than 65,536 rows, i.e. batches of more than 65,536 frames after the first convolution
    (pytorch/pytorch#192016). The parameters keep their (C, F) shape and names, so older
    checkpoints load unchanged.
    """

    def __init__(self, channels: int, freq: int):
        super().__init__()
        self.norm = nn.LayerNorm((channels, freq))
        self.width = channels * freq  # a constant, so exports keep N and T dynamic

    def forward(self, x: Tensor) -> Tensor:
        frames = x.transpose(1, 2)  # (N, T, C, F)
        norm = self.norm
        rows = F.layer_norm(frames.flatten(2), (self.width,), norm.weight.reshape(-1), norm.bias.reshape(-1), norm.eps)
        return rows.view_as(frames).transpose(1, 2)  # (N, C, T, F)


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


class RelPosConformerBlock(ConformerBlock):
    """A :class:`ConformerBlock` whose self-attention is :class:`~asrflow.model.positions.RelPositionAttention`
    (``train.model.attention: rel_pos``) in place of torchaudio's."""

    def __init__(self, layer: nn.Module, channels: int, num_heads: int, attention_dropout: float):
        super().__init__(layer, channels)
        self.self_attn = RelPositionAttention(channels, num_heads, attention_dropout)

    def forward(self, x: Tensor, padding_mask: Tensor) -> Tensor:
        """``x`` (T, N, D), ``padding_mask`` (N, T) True at padded frames -> (T, N, D)."""
        x = self.ffn1(x) * 0.5 + x
        residual = x
        attended = self.self_attn(self.self_attn_layer_norm(x).transpose(0, 1), padding_mask)  # (N, T, D)
        x = self.self_attn_dropout(attended.transpose(0, 1)) + residual
        x = self.conv_module(x.transpose(0, 1), padding_mask).transpose(0, 1) + x
        x = self.ffn2(x) * 0.5 + x
        return self.final_layer_norm(x)


class ConformerCtc(nn.Module):
    """Fbank frames in, per-frame log-probabilities over the vocabulary (blank = 0) out.

    An utterance's output does not depend on the batch it is in nor on its padding: every
    part of the encoder either works frame by frame or masks the padded frames.
    """

    #: Python-side properties that ``torch.jit.script`` (the TorchScript export) must not compile.
    __jit_unused_properties__ = ["shape"]

    def __init__(self, config: ModelConfig, *, input_dim: int, vocab_size: int):
        super().__init__()
        self.config, self.input_dim, self.vocab_size = config, input_dim, vocab_size
        self.subsampling = Conv2dSubsampling(
            input_dim, config.d_model, config.subsampling_channels, norm=config.subsampling_norm
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
        if config.attention == "rel_pos":
            self.encoder.conformer_layers = nn.ModuleList(
                RelPosConformerBlock(layer, config.d_model, config.num_heads, config.attention_dropout)
                for layer in self.encoder.conformer_layers
            )
        else:
            self.encoder.conformer_layers = nn.ModuleList(
                ConformerBlock(layer, config.d_model) for layer in self.encoder.conformer_layers
            )
            for block in self.encoder.conformer_layers:
                block.self_attn.dropout = config.attention_dropout  # torchaudio gives it ``dropout``
        self.absolute_positions = config.attention == "abs_pos"
        self.head = nn.Linear(config.d_model, vocab_size)
        if config.blank_bias_init is not None:
            with torch.no_grad():
                self.head.bias[BLANK_ID] = config.blank_bias_init

    @property
    def shape(self) -> dict:
        """This model's :func:`shape_record`."""
        return shape_record(self.config, input_dim=self.input_dim, vocab_size=self.vocab_size)

    def forward(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """Encode a padded batch.

        Args:
            features: (N, T, F) normalised fbank, 10 ms frames.
            lengths: (N,) valid frames per utterance.

        Returns:
            log_probs: (N, T', V) log-softmax over the vocabulary, T' = ``subsampled_lengths(T)``.
            out_lengths: (N,) valid output frames (40 ms each).
        """
        x = self.subsampling(features)  # (N, T', D)
        if self.absolute_positions:
            x = add_absolute_positions(x)
        x = self.dropout(x)
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


def build_model(config: ModelConfig, *, input_dim: int, vocab_size: int) -> ConformerCtc:
    """Construct the model for ``input_dim`` fbank bins and ``vocab_size`` classes (blank included), parameters
    drawn from the current torch RNG."""
    return ConformerCtc(config, input_dim=input_dim, vocab_size=vocab_size)


def build_from_record(record: dict) -> ConformerCtc:
    """The model a :func:`shape_record` describes (parameters drawn from the current torch RNG)."""
    config, input_dim, vocab_size = config_from_record(record)
    return build_model(config, input_dim=input_dim, vocab_size=vocab_size)


__all__ = [
    "HEAD_PREFIX",
    "ConformerCtc",
    "ModelConfig",
    "build_from_record",
    "build_model",
    "config_from_record",
    "count_parameters",
    "shape_record",
    "subsampled_lengths",
]
