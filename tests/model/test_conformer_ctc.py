"""Conformer-CTC shapes and length bookkeeping."""

from __future__ import annotations

import pytest
import torch

from asrflow.data.loading.ctc_filter import ctc_frames_needed, output_frames
from asrflow.errors import AsrflowError
from asrflow.model.conformer_ctc import (
    ConvFrameNorm,
    ModelConfig,
    build_from_record,
    build_model,
    config_from_record,
    shape_record,
    subsampled_lengths,
)
from asrflow.model.positions import ATTENTION_KINDS
from asrflow.tokenizer import BLANK_ID

#: A small ``train.model`` section (d_model 32, 2 heads, 2 layers, kernel 7) with the wide front end of
#: d_model channels and no norm, and a blank bias drawn like the others.
SMALL = {
    "d_model": 32,
    "num_heads": 2,
    "ffn_dim": 64,
    "num_layers": 2,
    "conv_kernel_size": 7,
    "dropout": 0.1,
    "attention_dropout": 0.0,
    "subsampling_channels": None,
    "subsampling_norm": False,
    "blank_bias_init": None,
    "attention": "none",
}


def small_config(**fields) -> ModelConfig:
    """:data:`SMALL`, ``fields`` replacing its keys."""
    return ModelConfig(**{**SMALL, **fields})


def small_model(*, input_dim: int = 80, vocab_size: int = 9, **fields):
    """The model of :func:`small_config` for ``input_dim`` bins and ``vocab_size`` classes."""
    return build_model(small_config(**fields), input_dim=input_dim, vocab_size=vocab_size)


def test_output_shapes_and_lengths():
    torch.manual_seed(0)
    model = small_model(num_layers=1, conv_kernel_size=15)
    features = torch.randn(3, 101, 80)
    lengths = torch.tensor([101, 57, 20])
    log_probs, out_lens = model(features, lengths)
    assert log_probs.shape == (3, int(subsampled_lengths(torch.tensor(101))), 9)
    assert out_lens.tolist() == subsampled_lengths(lengths).tolist() == [24, 13, 4]
    assert torch.allclose(log_probs.exp().sum(-1), torch.ones(3, log_probs.size(1)), atol=1e-5)


def _saved_square_maps(model, features: torch.Tensor, lengths: torch.Tensor) -> list[tuple[int, ...]]:
    """Shapes of the tensors a training forward keeps for the backward whose last two axes are (T', T')."""
    square = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() >= 2 and tensor.shape[-1] == tensor.shape[-2] == frames:
            square.append(tuple(tensor.shape))
        return tensor

    frames = int(subsampled_lengths(torch.tensor(features.size(1))))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(features, lengths)
    return square


@pytest.mark.parametrize("attention_dropout", [0.0, 0.2])
def test_attention_dropout_decides_whether_attention_maps_are_kept(attention_dropout):
    """Without attention-weight dropout the CPU's fused attention keeps no (N, heads, T', T') map per layer."""
    torch.manual_seed(0)
    model = small_model(attention_dropout=attention_dropout, dropout=0.1).train()
    assert {block.self_attn.dropout for block in model.encoder.conformer_layers} == {attention_dropout}
    features, lengths = torch.randn(3, 201, 80), torch.tensor([201, 150, 90])
    square = _saved_square_maps(model, features, lengths)
    if attention_dropout:
        assert len(square) >= 2, "the unfused attention keeps its weights for the backward"
    else:
        assert square == []


def test_blank_bias_init_sets_only_the_blank_logit_bias():
    torch.manual_seed(0)
    drawn = small_model().head.bias.detach().clone()
    torch.manual_seed(0)
    biased = small_model(blank_bias_init=3.0).head.bias.detach()
    assert biased[BLANK_ID] == 3.0
    assert torch.equal(biased[1:], drawn[1:])  # the other classes keep the same draw
    assert drawn[BLANK_ID].abs() < 1.0  # default: drawn like the others (|bias| <= 1/sqrt(d_model))


#: (subsampling_channels, subsampling_norm): the old wide front end, and the narrow normalised default.
FRONT_ENDS = [(None, False), ((8, 32), True)]
#: Each attention kind with the plain front end, and the shipped one with the other front end.
MODELS = [(None, False, kind) for kind in ATTENTION_KINDS] + [((8, 32), True, "none")]


@pytest.mark.parametrize(("channels", "norm", "attention"), MODELS)
def test_outputs_do_not_depend_on_padding_or_batch(channels, norm, attention):
    """Padded to twice its length next to a longer utterance, an utterance's every output
    frame is what it is alone, to float rounding: attention masks the padding, and the
    convolution module zeroes it before its depthwise convolution. (Without that zeroing,
    the last kernel_size // 2 frames see the padding and two layers of attention spread the
    difference over all frames: about 4e-3 nats here.)"""
    torch.manual_seed(0)
    model = small_model(subsampling_channels=channels, subsampling_norm=norm, attention=attention).eval()
    utterance = torch.randn(1, 400, 80)
    alone, alone_lens = model(utterance, torch.tensor([400]))
    padded_input = torch.cat([torch.cat([utterance, torch.randn(1, 400, 80)], dim=1), torch.randn(1, 800, 80)])
    padded, lens = model(padded_input, torch.tensor([400, 800]))
    valid = int(alone_lens[0])
    assert int(lens[0]) == valid == alone.size(1)
    assert torch.allclose(alone[0], padded[0, :valid], atol=1e-5)


@pytest.mark.parametrize(("channels", "norm", "attention"), MODELS)
def test_training_gradients_do_not_depend_on_padding(channels, norm, attention):
    torch.manual_seed(0)
    model = small_model(subsampling_channels=channels, subsampling_norm=norm, dropout=0.0, attention=attention)
    utterance = torch.randn(1, 300, 80)
    grads = []
    for features, lengths in (
        (utterance, torch.tensor([300])),
        (torch.cat([utterance, 10 * torch.randn(1, 200, 80)], dim=1), torch.tensor([300])),
    ):
        model.zero_grad()
        log_probs, out_lens = model(features, lengths)
        log_probs[0, : int(out_lens[0])].sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for alone, padded in zip(*grads, strict=True):
        assert torch.allclose(alone, padded, atol=1e-4, rtol=1e-4)


def test_ctc_frame_requirements():
    assert ctc_frames_needed([1, 2, 3]) == 3
    assert ctc_frames_needed([1, 1, 2, 2, 2]) == 8
    assert output_frames(101) == 24


def test_subsampling_channels_set_the_front_end_width():
    small = small_model(vocab_size=10, d_model=48, ffn_dim=96, num_layers=1, subsampling_channels=[16, 8])
    convs = [m for m in small.subsampling.conv if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [16, 8]
    assert small.subsampling.out.in_features == 8 * 19  # 19 = ((80-1)//2-1)//2 frequency bins left
    assert small.config.subsampling_channels == (16, 8)
    log_probs, lengths = small(torch.randn(2, 100, 80), torch.tensor([100, 60]))
    assert log_probs.shape == (2, 24, 10) and lengths.tolist() == [24, 14]


def test_subsampling_norm_normalises_each_frame_of_both_convolutions():
    model = small_model(
        vocab_size=10,
        d_model=48,
        ffn_dim=96,
        num_layers=1,
        conv_kernel_size=15,
        subsampling_channels=[8, 32],
        subsampling_norm=True,
    )
    norms = [m for m in model.subsampling.conv if isinstance(m, ConvFrameNorm)]
    assert [tuple(n.norm.normalized_shape) for n in norms] == [(8, 39), (32, 19)]
    captured = []
    norms[1].register_forward_hook(lambda module, inputs, output: captured.append(output))
    model(torch.randn(2, 100, 80) * 7 + 3, torch.tensor([100, 60]))
    frames = captured[0].transpose(1, 2).flatten(2)  # (N, T', C * F')
    assert torch.allclose(frames.mean(-1), torch.zeros(2, 24), atol=1e-5)
    assert torch.allclose(frames.std(-1, unbiased=False), torch.ones(2, 24), atol=1e-3)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_conv_frame_norm_is_layer_norm_over_channels_and_frequency_at_any_batch_size(device):
    # 70,000 rows (N x T) is past the 65,536 where CUDA's LayerNorm backward broke for a 2-D normalized_shape.
    torch.manual_seed(0)
    norm = ConvFrameNorm(4, 9).to(device)
    with torch.no_grad():
        norm.norm.weight.normal_()
        norm.norm.bias.normal_()
    x = torch.randn(2, 4, 35_000, 9, device=device, requires_grad=True)
    grad = torch.randn_like(x)
    ours = torch.autograd.grad(norm(x), [x, norm.norm.weight, norm.norm.bias], grad)
    # The reference: nn.LayerNorm's own (C, F) norm in float64 on the CPU.
    leaves = [t.detach().cpu().double().requires_grad_() for t in (x, norm.norm.weight, norm.norm.bias)]
    reference = torch.nn.functional.layer_norm(leaves[0].transpose(1, 2), (4, 9), leaves[1], leaves[2])
    expected = torch.autograd.grad(reference.transpose(1, 2), leaves, grad.cpu().double())
    for got, want in zip(ours, expected, strict=True):
        assert got.shape == want.shape
        assert torch.allclose(got.cpu().double(), want, rtol=1e-4, atol=1e-3)


def test_bundles_without_subsampling_channels_load_with_the_old_front_end(yesno_data, tmp_path):
    """Bundles written before the fields existed had d_model channels in both convolutions, no norm (and no
    attention dropout, a drawn blank bias, no position information)."""
    from asrflow.serving.bundle import load_bundle, save_bundle
    from asrflow.tokenizer import MODEL_FILE, Tokenizer
    from tests.support.corpora import feature_config

    tokenizer = Tokenizer(yesno_data / "lang" / MODEL_FILE)
    torch.manual_seed(0)
    old = small_model(vocab_size=tokenizer.vocab_size, num_layers=1, subsampling_channels=(32, 32))
    path = tmp_path / "old.pt"
    cmvn = {"norm_means": [0.0] * 80, "norm_stds": [1.0] * 80}
    save_bundle(
        path,
        model_state=old.state_dict(),
        model_shape=old.shape,
        tokenizer=tokenizer,
        features=feature_config(),
        cmvn=cmvn,
        run_id=None,
    )
    payload = torch.load(path, weights_only=True)
    for key in ("subsampling_channels", "subsampling_norm", "attention_dropout", "blank_bias_init", "attention"):
        del payload["model_config"][key]  # as an older asrflow wrote it
    torch.save(payload, path)
    loaded = load_bundle(path)
    assert loaded.model.config.subsampling_channels == (32, 32)
    assert loaded.model.config.subsampling_norm is False
    assert loaded.model.config.attention_dropout == 0.0 and loaded.model.config.blank_bias_init is None
    assert loaded.model.config.attention == "none"
    assert (loaded.model.input_dim, loaded.model.vocab_size) == (80, tokenizer.vocab_size)
    features = torch.randn(1, 80, 80)
    with torch.no_grad():
        assert torch.equal(loaded.model(features, torch.tensor([80]))[0], old.eval()(features, torch.tensor([80]))[0])


def test_the_shape_record_rebuilds_the_same_model():
    """A bundle's record (the section with the input width and vocabulary size) builds the model it describes."""
    torch.manual_seed(0)
    model = small_model(vocab_size=11, subsampling_channels=(8, 16), subsampling_norm=True, blank_bias_init=2.0)
    record = model.shape
    assert record == shape_record(model.config, input_dim=80, vocab_size=11)
    assert record["input_dim"] == 80 and record["vocab_size"] == 11 and record["d_model"] == 32
    assert config_from_record(record) == (model.config, 80, 11)
    rebuilt = build_from_record(record)
    rebuilt.load_state_dict(model.state_dict())  # strict: raises unless the names and shapes are the same
    assert rebuilt.shape == record


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_heads": 3}, "train.model.num_heads = 3 must divide train.model.d_model (32)"),
        ({"conv_kernel_size": 8}, "train.model.conv_kernel_size = 8 must be odd"),
        ({"num_layers": 0}, "train.model.num_layers = 0 must be at least 1"),
        ({"dropout": 1.0}, "train.model.dropout = 1.0 must be in [0, 1)"),
        ({"attention_dropout": -0.1}, "train.model.attention_dropout = -0.1 must be in [0, 1)"),
        ({"subsampling_channels": [8]}, "train.model.subsampling_channels = [8] must be null"),
        (
            {"attention": "relative"},
            "train.model.attention = 'relative' is not valid; use one of none, abs_pos, rel_pos",
        ),
    ],
)
def test_a_bad_model_section_names_its_dotted_key(fields, message):
    with pytest.raises(AsrflowError) as error:
        small_config(**fields)
    assert str(error.value).startswith(f"params.yaml: {message}"), str(error.value)
