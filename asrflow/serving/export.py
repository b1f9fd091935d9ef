"""Export a model bundle's encoder to ONNX or TorchScript for serving without asrflow.

The exported graph maps normalised fbank ``features`` ``(N, T, F)`` (float32, what
:func:`asrflow.serving.inference.cut_features` returns: CMVN already applied) and ``lengths``
``(N,)`` (int64, valid frames) to ``log_probs`` ``(N, T', V)`` (natural-log CTC
posteriors, blank = 0) and ``out_lens`` ``(N,)`` (int64, valid 40 ms frames), with ``N``
and ``T`` free. Everything a caller needs to build the input and read the output (token
pieces, blank id, feature settings, CMVN statistics) travels inside the file as JSON:
ONNX ``metadata_props`` keys, or TorchScript ``_extra_files`` entries (see
:data:`METADATA_KEYS`).

The ONNX export traces the model (``torch.onnx.export`` with ``dynamo=False``; the dynamo
exporter needs ``onnxscript``, which is not a dependency). Two things keep the traced
graph dynamic in ``N`` and ``T``: the model sizes its padding mask from its tensor's time
axis, never from a Python number such as ``int(lengths.max())`` that tracing would freeze;
and :func:`exportable_model` passes key and value to the attention as views distinct from
the query. With one tensor for all three, ``nn.MultiheadAttention`` projects them in one
packed matmul whose time axis the exporter records as a constant, so a graph traced at
``T`` would fail at any other length; distinct tensors take the three-projection path,
the same function.

TorchScript is made with ``torch.jit.script`` (no tracing), so every shape stays dynamic.
"""

from __future__ import annotations

import copy
import json
import logging
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor

from asrflow.data.features.cmvn import cmvn_stats
from asrflow.errors import AsrflowError, require_extra
from asrflow.files import atomic_path
from asrflow.model.conformer_ctc import ConformerCtc
from asrflow.serving.bundle import Bundle, load_bundle
from asrflow.tokenizer import BLANK_ID

logger = logging.getLogger(__name__)

FORMATS = ("onnx", "torchscript")

#: The exported graph's input and output names (ONNX) / positions (TorchScript).
INPUT_NAMES = ("features", "lengths")
OUTPUT_NAMES = ("log_probs", "out_lens")

#: Metadata stored with the exported model, each a JSON string.
METADATA_KEYS = ("tokens", "blank_id", "features", "cmvn", "model_config", "subsampling")

#: Opset of the ONNX export (17 has LayerNormalization as one op).
ONNX_OPSET = 17


def exportable_model(model: ConformerCtc) -> ConformerCtc:
    """A copy of ``model`` in eval mode whose attention takes key and value as tensors distinct from the query."""
    exported = copy.deepcopy(model).eval()
    for layer in exported.encoder.conformer_layers:
        layer.distinct_key_value = True
    return exported


def metadata(bundle: Bundle) -> dict[str, str]:
    """What a caller needs besides the graph, as JSON strings keyed by :data:`METADATA_KEYS`."""
    stats = cmvn_stats(bundle.mvn)
    return {
        "tokens": json.dumps(bundle.tokenizer.pieces, ensure_ascii=False),
        "blank_id": json.dumps(BLANK_ID),
        "features": json.dumps(asdict(bundle.features)),
        "cmvn": json.dumps(stats),
        "model_config": json.dumps(bundle.model.shape),
        "subsampling": json.dumps("out_lens = ((lengths - 1) // 2 - 1) // 2, at least 1"),
    }


def example_inputs(bundle: Bundle, batch: int = 2, frames: int = 200) -> tuple[Tensor, Tensor]:
    """A padded example batch: ``features`` (batch, frames, F) and unequal ``lengths`` (batch,)."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(batch, frames, bundle.model.input_dim, generator=generator)
    lengths = torch.linspace(frames, frames // 2, batch).to(torch.int64)
    return features, lengths


def export_onnx(bundle: Bundle, out: Path) -> None:
    """Write the encoder as ONNX (opset :data:`ONNX_OPSET`, dynamic ``N`` and ``T``)."""
    onnx = require_extra("onnx", "onnx", "ONNX export")

    encoder = exportable_model(bundle.model)
    dims = {"features": {0: "N", 1: "T"}, "lengths": {0: "N"}, "log_probs": {0: "N", 1: "T_out"}, "out_lens": {0: "N"}}
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
    encoder = exportable_model(bundle.model)
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
