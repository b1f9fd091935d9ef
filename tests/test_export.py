"""``asrflow export``: the ONNX and TorchScript encoders compute what the model bundle computes.

Compared on real yesno feature batches of different sizes, lengths and padding, with
the model trained in this session (the ``yesno_model`` fixture). Tolerances on log-probabilities
(natural log): ONNX Runtime 1e-4 absolute (it fuses and reorders float32 arithmetic;
observed differences are about 1e-5), TorchScript 1e-5 (the same kernels; observed 0).
Output lengths must be equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from lhotse import CutSet

from asrflow.data.features.config import FeatureConfig
from asrflow.data.manifests import load_cuts
from asrflow.errors import AsrflowError
from asrflow.model.conformer_ctc import build_from_record
from asrflow.serving.bundle import load_bundle, read_bundle, save_bundle
from asrflow.serving.cli import main
from asrflow.serving.export import export_model
from asrflow.serving.inference import cut_features, log_probs
from asrflow.tokenizer import Tokenizer

ONNX_ATOL = 1e-4
TORCHSCRIPT_ATOL = 1e-5


def with_attention(model_path: Path, attention: str, out: Path) -> Path:
    """The bundle at ``model_path`` with its model rebuilt for ``train.model.attention: attention`` (weights
    drawn at seed 0: the export must compute what the model computes, trained or not)."""
    payload = read_bundle(model_path)
    shape = {**payload["model_config"], "attention": attention}
    torch.manual_seed(0)
    model = build_from_record(shape)
    features = FeatureConfig(**payload["features"])
    tokenizer = Tokenizer(payload["tokenizer"].numpy().tobytes())
    state = model.state_dict()
    save_bundle(
        out,
        model_state=state,
        model_shape=shape,
        tokenizer=tokenizer,
        features=features,
        cmvn=payload["cmvn"],
        run_id=None,
    )
    return out


@pytest.fixture(scope="module", params=["none", "rel_pos", "abs_pos"])
def model_path(request, yesno_model, tmp_path_factory) -> Path:
    """The trained yesno bundle (``none``, the shipped attention) and the same with each other attention."""
    if request.param == "none":
        return yesno_model
    return with_attention(yesno_model, request.param, tmp_path_factory.mktemp("attention") / "model.pt")


@pytest.fixture(scope="module")
def bundle(model_path):
    return load_bundle(model_path)


@pytest.fixture(scope="module")
def batches(bundle, yesno_data) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Normalised fbank ``(N, T, F)`` and int64 lengths ``(N,)``: N = 1, 3, 3, 6; padded and not; T from 150 up."""
    cuts = sorted(load_cuts(yesno_data / "fbank", "test"), key=lambda cut: cut.duration)
    groups = [cuts[:1], cuts[1:4], [cuts[-1], cuts[0], cuts[len(cuts) // 2]], cuts[-6:]]
    out = []
    for group in groups:
        features, lengths = cut_features(bundle, CutSet.from_cuts(group))
        out.append((features, lengths.to(torch.int64)))
    features, lengths = out[2]
    out.append((features[:, :150].contiguous(), lengths.clamp(max=150)))  # shorter than the export example
    return out


def _reference(bundle, features, lengths):
    scores, out_lens = log_probs(bundle, features, lengths)  # (N, T', V), (N,)
    return scores.numpy(), out_lens.numpy()


def test_onnx_export_matches_the_bundle(bundle, batches, model_path, *, tmp_path, capsys):
    import onnx
    import onnxruntime

    out = tmp_path / "encoder.onnx"
    assert main(["export", "--model", str(model_path), "--format", "onnx", "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["features", "lengths"]
    assert [o.name for o in session.get_outputs()] == ["log_probs", "out_lens"]
    for features, lengths in batches:
        expected, expected_lens = _reference(bundle, features, lengths)
        got, got_lens = session.run(None, {"features": features.numpy(), "lengths": lengths.numpy()})
        assert got.shape == expected.shape
        np.testing.assert_array_equal(got_lens, expected_lens)
        np.testing.assert_allclose(got, expected, rtol=0, atol=ONNX_ATOL)
        assert (got.argmax(-1) == expected.argmax(-1)).mean() > 0.999

    metadata = {prop.key: json.loads(prop.value) for prop in onnx.load(str(out)).metadata_props}
    assert metadata["tokens"] == bundle.tokenizer.pieces
    assert metadata["blank_id"] == 0
    assert metadata["features"]["sampling_rate"] == bundle.features.sampling_rate
    assert len(metadata["cmvn"]["norm_means"]) == bundle.features.num_mel_bins


def test_torchscript_export_matches_the_bundle(bundle, batches, model_path, tmp_path):
    out = tmp_path / "encoder.pt"
    assert main(["export", "--model", str(model_path), "--format", "torchscript", "--out", str(out)]) == 0
    extra = {"tokens": ""}
    scripted = torch.jit.load(str(out), _extra_files=extra)
    assert json.loads(extra["tokens"]) == bundle.tokenizer.pieces
    for features, lengths in batches:
        expected, expected_lens = _reference(bundle, features, lengths)
        with torch.no_grad():
            got, got_lens = scripted(features, lengths)
        np.testing.assert_array_equal(got_lens.numpy(), expected_lens)
        np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=TORCHSCRIPT_ATOL)


def test_export_rejects_unknown_formats_and_missing_models(yesno_model, tmp_path, capsys):
    with pytest.raises(AsrflowError, match="not supported"):
        export_model(yesno_model, "tflite", tmp_path / "x")
    assert (
        main(["export", "--model", str(tmp_path / "nope.pt"), "--format", "onnx", "--out", str(tmp_path / "x.onnx")])
        == 2
    )
    assert "nope.pt" in capsys.readouterr().err
    assert not (tmp_path / "x.onnx").exists()
