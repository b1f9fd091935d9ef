"""Conformer-CTC acoustic model: convolutional subsampling by 4, a Conformer encoder, a CTC head."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn
from torchaudio.models import Conformer


@dataclass(frozen=True)
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


def subsampled_lengths(lengths: Tensor) -> Tensor:
    """Frames left after :class:`Conv2dSubsampling` for input ``lengths`` (N,) in frames."""
    return ((lengths - 1) // 2 - 1) // 2


class Conv2dSubsampling(nn.Module):
    """Two 3x3 convolutions with stride 2: (N, T, F) -> (N, T', d_model), T' = ((T-1)//2-1)//2."""

    def __init__(self, input_dim: int, d_model: int):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, d_model, kernel_size=3, stride=2),
            nn.ReLU(),
            nn.Conv2d(d_model, d_model, kernel_size=3, stride=2),
            nn.ReLU(),
        )
        freq = ((input_dim - 1) // 2 - 1) // 2
        self.out = nn.Linear(d_model * freq, d_model)

    def forward(self, features: Tensor) -> Tensor:
        x = self.conv(features.unsqueeze(1))  # (N, C, T', F')
        n, c, t, f = x.shape
        return self.out(x.transpose(1, 2).reshape(n, t, c * f))  # (N, T', d_model)


class FrameLayerNorm(nn.Module):
    """LayerNorm over channels for each frame of a (N, C, T) tensor."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = nn.LayerNorm(channels)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x.transpose(1, 2)).transpose(1, 2)  # (N, C, T)


class ConformerCtc(nn.Module):
    """Fbank frames in, per-frame log-probabilities over the vocabulary (blank = 0) out."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.subsampling = Conv2dSubsampling(config.input_dim, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.encoder = Conformer(
            input_dim=config.d_model,
            num_heads=config.num_heads,
            ffn_dim=config.ffn_dim,
            num_layers=config.num_layers,
            depthwise_conv_kernel_size=config.conv_kernel_size,
            dropout=config.dropout,
            use_group_norm=True,  # replaced just below
        )
        # Normalise each frame over its channels (not BatchNorm's batch statistics, nor
        # GroupNorm's statistics over all frames, padding included): an utterance's output
        # then does not depend on the batch it is in, nor on how much it was padded, except
        # that the depthwise convolution still sees up to kernel_size // 2 padded frames at
        # the end of each utterance.
        for layer in self.encoder.conformer_layers:
            norm_index = next(i for i, m in enumerate(layer.conv_module.sequential) if isinstance(m, nn.GroupNorm))
            layer.conv_module.sequential[norm_index] = FrameLayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size)

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
        out_lengths = subsampled_lengths(lengths).clamp(min=1, max=x.size(1))
        x, out_lengths = self.encoder(x, out_lengths)  # (N, T', D)
        return self.head(x).log_softmax(dim=-1), out_lengths  # (N, T', V)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def build_model(config: ModelConfig) -> ConformerCtc:
    """Construct the model (parameters drawn from the current torch RNG)."""
    return ConformerCtc(config)


__all__ = ["ConformerCtc", "ModelConfig", "build_model", "count_parameters", "subsampled_lengths"]
