"""The train stage reads its inputs from its command line (``--fbank``, ``--lang``), like the other stages."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from asrflow.data.features import FeatureConfig
from asrflow.errors import EXIT_USER_ERROR
from asrflow.serving.bundle import load_bundle
from asrflow.testing.repo import write_shipped_params
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
