"""The train stage reads its inputs from its command line (``--fbank``, ``--lang``), like the other stages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from asrflow.errors import EXIT_USER_ERROR
from asrflow.serving.bundle import load_bundle
from stages.train import main
from tests.support.tiny_config import tiny_bundle, tiny_params

#: The tiny run (tests.support.tiny_config) for one epoch of large batches, with no checkpoint or validation
#: before the end: a few CPU-seconds.
STAGE_RUN = {
    "train.data.max_duration_s": 60.0,
    "train.optim.epochs": 1,
    "train.optim.warmup_steps": 2,
    "train.checkpoint.checkpoint_every_steps": 1000,
    "train.checkpoint.validate_every_steps": 1000,
}


def write_params(folder: Path, data: Path, overrides: dict | None = None) -> Path:
    """``folder/params.yaml``: the tiny run of :data:`STAGE_RUN` with the features ``data`` was computed with."""
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(tiny_params(data, {**STAGE_RUN, **(overrides or {})})))
    return path


@pytest.fixture
def params_file(yesno_data, tmp_path) -> Path:
    return write_params(tmp_path, yesno_data)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.slow
def test_trains_from_the_folders_on_its_command_line(yesno_data, params_file, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = tmp_path / "exp"
    main(
        [
            "--params",
            str(params_file),
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
def test_a_missing_input_folder_is_named(yesno_data, params_file, tmp_path, capsys, *, monkeypatch, missing):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    inputs = {"--fbank": str(yesno_data / "fbank"), "--lang": str(yesno_data / "lang")}
    inputs[missing] = str(tmp_path / "nowhere")
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "--params",
                str(params_file),
                *(arg for pair in inputs.items() for arg in pair),
                "--exp",
                str(tmp_path / "exp"),
            ]
        )
    assert exit_info.value.code == EXIT_USER_ERROR
    [error] = error_lines(capsys.readouterr().err)
    assert str(tmp_path / "nowhere") in error, error
    assert not (tmp_path / "exp" / "model.pt").exists()


@pytest.mark.slow
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
    params = write_params(tmp_path, yesno_data, {"train.finetune.init_from": init_from})
    with pytest.raises(SystemExit) as exit_info:
        main(["--params", str(params), "--fbank", str(yesno_data / "fbank"), "--lang", str(yesno_data / "lang")])
    assert exit_info.value.code == EXIT_USER_ERROR
    [error] = error_lines(capsys.readouterr().err)
    assert error.startswith(f"error: train.finetune.init_from: {init_from}") and expected in error, error
    assert not (tmp_path / "exp" / "model.pt").exists()
