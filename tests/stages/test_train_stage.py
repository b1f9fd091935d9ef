"""The train stage reads its inputs from its command line (``--fbank``, ``--lang``), like the other stages."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from asrflow.data.features import FeatureConfig
from asrflow.errors import EXIT_USER_ERROR
from asrflow.serving.bundle import load_bundle
from asrflow.testing.repo import write_shipped_params
from asrflow.testing.tiny_config import tiny_bundle
from asrflow.training.config import KEY_SECTION
from stages.train import main

#: A model and run small enough to train in a few CPU-seconds (conftest's tiny model, one epoch).
TINY = {
    "d_model": 32,
    "num_heads": 2,
    "ffn_dim": 64,
    "num_layers": 1,
    "conv_kernel_size": 7,
    "max_duration_s": 60.0,
    "num_workers": 0,
    "epochs": 1,
    "warmup_steps": 2,
    "num_threads": 1,
    "checkpoint_every_steps": 1000,
    "validate_every_steps": 1000,
    "average_last": 1,
}


@pytest.fixture
def tiny_params(tmp_path):
    """The shipped params with the TINY run and the features of conftest's ``yesno_data`` (the defaults)."""
    features = {f"features.{key}": value for key, value in asdict(FeatureConfig()).items()}
    return write_shipped_params(
        tmp_path, {**features, **{f"{KEY_SECTION[key]}.{key}": value for key, value in TINY.items()}}
    )


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_trains_from_the_folders_on_its_command_line(yesno_data, tiny_params, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = tmp_path / "exp"
    main(
        [
            "--params",
            str(tiny_params),
            "--fbank",
            str(yesno_data / "fbank"),
            "--lang",
            str(yesno_data / "lang"),
            "--exp",
            str(exp),
        ]
    )
    bundle = load_bundle(exp / "model.pt")
    assert bundle.tokenizer.pieces == [line.split()[0] for line in (yesno_data / "lang" / "tokens.txt").open()]
    assert all(torch.isfinite(p).all() for p in bundle.model.parameters())
    assert (exp / "plots" / "train_loss.csv").read_text().startswith("step,loss")


@pytest.mark.parametrize("missing", ["--fbank", "--lang"])
def test_a_missing_input_folder_is_named(yesno_data, tiny_params, tmp_path, capsys, *, monkeypatch, missing):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    inputs = {"--fbank": str(yesno_data / "fbank"), "--lang": str(yesno_data / "lang")}
    inputs[missing] = str(tmp_path / "nowhere")
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "--params",
                str(tiny_params),
                *(arg for pair in inputs.items() for arg in pair),
                "--exp",
                str(tmp_path / "exp"),
            ]
        )
    assert exit_info.value.code == EXIT_USER_ERROR
    [error] = error_lines(capsys.readouterr().err)
    assert str(tmp_path / "nowhere") in error, error
    assert not (tmp_path / "exp" / "model.pt").exists()


@pytest.mark.parametrize(
    ("init_from", "expected"),
    [
        ("elsewhere/base.pt", "is outside pretrained/"),
        ("pretrained/wide.pt", "train.model.d_model 32 vs 48"),
        ("pretrained/none.pt", "no such file"),
        ("models:/nobody/1", "not found in the MLflow store sqlite:///"),
    ],
)
def test_a_bad_start_model_is_one_line_and_exit_2(yesno_data, tmp_path, capsys, *, monkeypatch, init_from, expected):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    for folder in ("elsewhere", "pretrained"):
        (tmp_path / folder).mkdir()
    tiny_bundle(tmp_path / "elsewhere" / "base.pt", yesno_data / "lang", seed=1)
    tiny_bundle(tmp_path / "pretrained" / "wide.pt", yesno_data / "lang", seed=1, d_model=48)
    features = {f"features.{key}": value for key, value in asdict(FeatureConfig()).items()}
    tiny = {f"{KEY_SECTION[key]}.{key}": value for key, value in {**TINY, "init_from": init_from}.items()}
    params = write_shipped_params(tmp_path, {**features, **tiny})
    with pytest.raises(SystemExit) as exit_info:
        main(["--params", str(params), "--fbank", str(yesno_data / "fbank"), "--lang", str(yesno_data / "lang")])
    assert exit_info.value.code == EXIT_USER_ERROR
    [error] = error_lines(capsys.readouterr().err)
    assert error.startswith(f"error: train.finetune.init_from: {init_from}") and expected in error, error
    assert not (tmp_path / "exp" / "model.pt").exists()
