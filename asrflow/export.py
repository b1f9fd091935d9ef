"""Export a model bundle's encoder to ONNX or TorchScript for serving without asrflow.

The exported graph maps normalised fbank ``features`` ``(N, T, F)`` (float32, what
:func:`asrflow.inference.cut_features` returns: CMVN already applied) and ``lengths``
``(N,)`` (int64, valid frames) to ``log_probs`` ``(N, T', V)`` (natural-log CTC
posteriors, blank = 0) and ``out_lens`` ``(N,)`` (int64, valid 40 ms frames), with ``N``
and ``T`` free. Everything a caller needs to build the input and read the output (token
pieces, blank id, feature settings, CMVN statistics) travels inside the file as JSON:
ONNX ``metadata_props`` keys, or TorchScript ``_extra_files`` entries (see
:data:`METADATA_KEYS`).

Two things in the PyTorch model do not survive ONNX tracing (``torch.onnx.export`` with
``dynamo=False``; the dynamo exporter needs ``onnxscript``, which is not a dependency),
and :class:`ExportableEncoder` avoids both while computing the same function:

- torchaudio's Conformer sizes its attention padding mask with ``int(lengths.max())``, a
  Python number tracing freezes to the example's length. Here the mask is sized from the
  tensor's own time axis, which is the same whenever the batch is padded to its longest
  utterance (always so for collated batches).
- ``nn.MultiheadAttention`` called with one tensor as query, key and value projects them
  with one packed matmul whose time axis the exporter records as a constant, so a graph
  traced at ``T`` fails at any other length. Here key and value are distinct views,
  which takes the three-projection path (see :class:`_ExportableLayer`).

TorchScript is made with ``torch.jit.script`` (no tracing), so every shape stays dynamic.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor, nn

from asrflow.bundle import Bundle, load_bundle
from asrflow.data.features import cmvn_stats
from asrflow.errors import AsrflowError
from asrflow.io import atomic_path
from asrflow.model.conformer_ctc import ConformerCtc, subsampled_lengths
from asrflow.tokenizer import BLANK_ID

logger = logging.getLogger("asrflow.export")

FORMATS = ("onnx", "torchscript")

#: The exported graph's input and output names (ONNX) / positions (TorchScript).
INPUT_NAMES = ("features", "lengths")
OUTPUT_NAMES = ("log_probs", "out_lens")

#: Metadata stored with the exported model, each a JSON string.
METADATA_KEYS = ("tokens", "blank_id", "features", "cmvn", "model_config", "subsampling")

#: Opset of the ONNX export (17 has LayerNormalization as one op).
ONNX_OPSET = 17


class _ExportableLayer(nn.Module):
    """torchaudio's ``ConformerLayer.forward`` (convolution after attention), export-safe.

    The attention gets its key and value as tensors distinct from the query. With one
    tensor for all three, PyTorch projects them in one packed matmul whose output the
    ONNX exporter gives a static time axis, freezing the traced length into a Reshape.
    Distinct tensors take the three-projection path: the same function, all shapes dynamic.
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        if layer.convolution_first:
            raise AsrflowError("export supports Conformer layers with the convolution after attention only")
        self.ffn1 = layer.ffn1
        self.self_attn_layer_norm = layer.self_attn_layer_norm
        self.self_attn = layer.self_attn
        self.self_attn_dropout = layer.self_attn_dropout
        self.conv_module = layer.conv_module
        self.ffn2 = layer.ffn2
        self.final_layer_norm = layer.final_layer_norm

    def forward(self, x: Tensor, padding_mask: Tensor) -> Tensor:
        """``x`` (T, N, D), ``padding_mask`` (N, T) True at padding -> (T, N, D)."""
        x = self.ffn1(x) * 0.5 + x
        residual = x
        query = self.self_attn_layer_norm(x)
        key = query.view_as(query)
        value = query.view_as(query)
        x, _ = self.self_attn(query, key, value, key_padding_mask=padding_mask, need_weights=False)
        x = self.self_attn_dropout(x) + residual
        x = self.conv_module(x.transpose(0, 1)).transpose(0, 1) + x
        x = self.ffn2(x) * 0.5 + x
        return self.final_layer_norm(x)


class ExportableEncoder(nn.Module):
    """:class:`ConformerCtc`'s forward in a form tracing keeps dynamic in ``N`` and ``T``.

    Shares the wrapped model's parameters; computes the same function in eval mode.
    """

    def __init__(self, model: ConformerCtc):
        super().__init__()
        self.subsampling = model.subsampling
        self.layers = nn.ModuleList(_ExportableLayer(layer) for layer in model.encoder.conformer_layers)
        self.head = model.head

    def forward(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """``features`` (N, T, F) and ``lengths`` (N,) -> ``log_probs`` (N, T', V), ``out_lens`` (N,)."""
        x = self.subsampling(features)  # (N, T', D)
        frames = torch.arange(x.size(1), device=lengths.device, dtype=lengths.dtype)  # (T',)
        out_lens = torch.minimum(subsampled_lengths(lengths).clamp(min=1), frames[-1] + 1)  # (N,)
        padding_mask = frames.unsqueeze(0) >= out_lens.unsqueeze(1)  # (N, T'), True = padding
        x = x.transpose(0, 1)  # (T', N, D)
        for layer in self.layers:
            x = layer(x, padding_mask)
        return self.head(x.transpose(0, 1)).log_softmax(dim=-1), out_lens  # (N, T', V), (N,)


def metadata(bundle: Bundle) -> dict[str, str]:
    """What a caller needs besides the graph, as JSON strings keyed by :data:`METADATA_KEYS`."""
    stats = cmvn_stats(bundle.mvn)
    return {
        "tokens": json.dumps(bundle.tokenizer.pieces, ensure_ascii=False),
        "blank_id": json.dumps(BLANK_ID),
        "features": json.dumps(asdict(bundle.features)),
        "cmvn": json.dumps(stats),
        "model_config": json.dumps(asdict(bundle.model.config)),
        "subsampling": json.dumps("out_lens = ((lengths - 1) // 2 - 1) // 2, at least 1"),
    }


def example_inputs(bundle: Bundle, batch: int = 2, frames: int = 200) -> tuple[Tensor, Tensor]:
    """A padded example batch: ``features`` (batch, frames, F) and unequal ``lengths`` (batch,)."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(batch, frames, bundle.model.config.input_dim, generator=generator)
    lengths = torch.linspace(frames, frames // 2, batch).to(torch.int64)
    return features, lengths


def export_onnx(bundle: Bundle, out: Path) -> None:
    """Write the encoder as ONNX (opset :data:`ONNX_OPSET`, dynamic ``N`` and ``T``)."""
    import onnx

    encoder = ExportableEncoder(bundle.model).eval()
    dims = {"features": {0: "N", 1: "T"}, "lengths": {0: "N"}, "log_probs": {0: "N", 1: "T_out"},
            "out_lens": {0: "N"}}
    with atomic_path(out) as tmp, torch.no_grad():
        torch.onnx.export(
            encoder,
            example_inputs(bundle),
            str(tmp),
            input_names=list(INPUT_NAMES),
            output_names=list(OUTPUT_NAMES),
            dynamic_axes=dims,
            opset_version=ONNX_OPSET,
            dynamo=False,
        )
        graph = onnx.load(str(tmp))
        for key, value in metadata(bundle).items():
            graph.metadata_props.add(key=key, value=value)
        onnx.checker.check_model(graph)
        onnx.save(graph, str(tmp))


def export_torchscript(bundle: Bundle, out: Path) -> None:
    """Write the encoder as TorchScript (scripted, so every shape stays dynamic)."""
    encoder = ExportableEncoder(bundle.model).eval()
    with warnings.catch_warnings():
        # PyTorch 2.9+ marks TorchScript deprecated (FutureWarning); it still works and loads anywhere.
        warnings.filterwarnings("ignore", category=FutureWarning, message=r".*torch\.jit")
        scripted = torch.jit.script(encoder)
        with atomic_path(out) as tmp:
            torch.jit.save(scripted, str(tmp), _extra_files=metadata(bundle))


def export_model(model_path: str | Path, fmt: str, out: str | Path) -> Path:
    """Export the encoder of the bundle at ``model_path`` as ``fmt`` (``onnx`` or ``torchscript``) to ``out``.

    Raises:
        AsrflowError: unknown format, or a model file that cannot be loaded.
    """
    if fmt not in FORMATS:
        raise AsrflowError(f"export format {fmt!r} is not supported; use one of {', '.join(FORMATS)}")
    bundle = load_bundle(model_path)
    out = Path(out)
    if fmt == "onnx":
        export_onnx(bundle, out)
    else:
        export_torchscript(bundle, out)
    logger.info("exported %s to %s (%s)", model_path, out, fmt)
    return out
