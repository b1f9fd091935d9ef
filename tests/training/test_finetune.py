"""Fine-tuning (``train.finetune``): what a fresh run starts from, what stays frozen, what a resume keeps.

Most start models here are bundles of freshly drawn weights (no training needed to tell loaded weights
from drawn ones); the step-0 checkpoint of a fresh run holds exactly the weights it starts from.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from asrflow.errors import AsrflowError
from asrflow.model.conformer_ctc import HEAD_PREFIX
from asrflow.tokenizer import MODEL_FILE, Tokenizer, train_tokenizer
from asrflow.training.checkpoint import checkpoint_path, load_checkpoint
from asrflow.training.init_model import load_init_model
from asrflow.training.observers import TrainObserver
from tests.support.corpora import tokenizer_config
from tests.support.exact_resume import OVERRIDES, assert_identical, final_state, resumed_from
from tests.support.mlflow_store import fresh_mlflow_store
from tests.support.tiny_config import tiny_bundle, tiny_settings
from tests.support.train_entry import TrainingProcess, faulty_tiny_trainer, run_training, train_in_process

STEPS = {
    "train.optim.epochs": 1,
    "train.checkpoint.checkpoint_every_steps": 1,
    "train.checkpoint.validate_every_steps": 1000,
    "train.checkpoint.keep_last": 50,
}
INIT_FROM = "train.finetune.init_from"


def weights_at(exp: Path, step: int) -> dict[str, torch.Tensor]:
    return load_checkpoint(checkpoint_path(exp / "checkpoints", step))["model"]


def equal(a: dict, b: dict, *, head: bool) -> bool:
    names = [name for name in b if name.startswith(HEAD_PREFIX) == head]
    return bool(names) and all(torch.equal(a[name], b[name]) for name in names)


@pytest.fixture(scope="module")
def start(yesno_data, tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("start")
    return folder / "base.pt", tiny_bundle(folder / "base.pt", yesno_data / "lang", seed=7)


def other_tokenizer(yesno_data: Path, folder: Path) -> Path:
    """``folder`` with yesno's features and a char tokenizer in place of its own (same file names)."""
    (folder / "fbank").symlink_to(yesno_data / "fbank")
    train_tokenizer(["YES NO MAYBE", "NO YES"], folder / "lang", tokenizer_config(model_type="char", vocab_size=20))
    return folder


def test_same_tokenizer_loads_encoder_and_head(yesno_data, start, tmp_path, uri):
    path, weights = start
    lang_copy = tmp_path / "data"  # the same tokenizer in another folder: compared by content
    lang_copy.mkdir()
    (lang_copy / "fbank").symlink_to(yesno_data / "fbank")
    shutil.copytree(yesno_data / "lang", lang_copy / "lang")
    train_in_process(lang_copy, tmp_path / "exp", {**STEPS, INIT_FROM: str(path)}, uri)
    first = weights_at(tmp_path / "exp", 0)
    assert equal(first, weights, head=False) and equal(first, weights, head=True)


def test_other_tokenizer_draws_a_fresh_head(yesno_data, start, tmp_path, uri, caplog):
    path, weights = start
    data = other_tokenizer(yesno_data, tmp_path)
    with caplog.at_level(logging.INFO, logger="asrflow.training.init_model"):
        train_in_process(data, tmp_path / "exp", {**STEPS, INIT_FROM: str(path)}, uri)
    first = weights_at(tmp_path / "exp", 0)
    assert equal(first, weights, head=False)
    vocab = Tokenizer(data / "lang" / MODEL_FILE).vocab_size
    assert first["head.weight"].shape[0] == vocab != weights["head.weight"].shape[0]
    [line] = [r.getMessage() for r in caplog.records if "CTC head is drawn fresh" in r.getMessage()]
    assert "its tokenizer differs" in line and str(path) in line


def test_frozen_encoder_stays_equal_for_its_steps_and_its_lr_is_scaled(yesno_data, start, tmp_path, uri):
    path, weights = start
    overrides = {
        **STEPS,
        INIT_FROM: str(path),
        "train.finetune.freeze_encoder_steps": 3,
        "train.finetune.encoder_lr_scale": 0.1,
    }
    train_in_process(yesno_data, tmp_path / "exp", overrides, uri)
    for step in (1, 2, 3):
        now = weights_at(tmp_path / "exp", step)
        assert equal(now, weights, head=False), f"the encoder moved at step {step}"
        assert not equal(now, weights, head=True), f"the head did not train at step {step}"
    assert not equal(weights_at(tmp_path / "exp", 4), weights, head=False), "the encoder stayed frozen after 3"
    groups = load_checkpoint(checkpoint_path(tmp_path / "exp" / "checkpoints", 4))["optimizer"]["param_groups"]
    assert [group["initial_lr"] for group in groups] == pytest.approx([0.003, 0.0003])


@pytest.mark.parametrize(
    ("model", "expected"),
    [({"d_model": 48, "ffn_dim": 64}, "train.model.d_model 32 vs 48"), ({"num_layers": 2}, "num_layers 1 vs 2")],
)
def test_an_encoder_of_another_shape_is_refused_naming_it(yesno_data, tmp_path, uri, *, model, expected):
    tiny_bundle(tmp_path / "other.pt", yesno_data / "lang", seed=1, **model)
    with pytest.raises(AsrflowError, match="does not match params.yaml") as error:
        faulty_tiny_trainer(yesno_data, tmp_path / "exp", {INIT_FROM: str(tmp_path / "other.pt")}, uri)
    assert expected in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("kind", ["missing", "text", "torch"])
def test_a_missing_or_foreign_file_is_refused(tmp_path, kind):
    path = tmp_path / "model.pt"
    if kind == "text":
        path.write_text("not a model\n")
    elif kind == "torch":
        torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(AsrflowError) as error:
        load_init_model(str(path))
    message = str(error.value)
    assert message.startswith(f"train.finetune.init_from: {path}") and "\n" not in message
    assert ("no such file" if kind == "missing" else "is not an asrflow model") in message


def test_an_unknown_mlflow_model_names_the_store(tmp_path, uri):
    with pytest.raises(AsrflowError, match="not found in the MLflow store") as error:
        load_init_model("models:/nobody/1", tracking_uri=uri)
    assert str(tmp_path / "mlflow.db") in str(error.value)


@pytest.mark.slow
def test_mlflow_model_uris_resolve_to_the_logged_bundle(yesno_data, tmp_path, uri):
    from mlflow import MlflowClient

    exp = tmp_path / "base"
    train_in_process(yesno_data, exp, {"train.optim.epochs": 1, "run.register_model_name": "yesno-base"}, uri)
    digest = hashlib.sha256((exp / "model.pt").read_bytes()).hexdigest()[:16]
    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("asrflow").experiment_id])
    [model_id] = [output.model_id for output in run.outputs.model_outputs]
    for source in ("models:/yesno-base/1", f"models:/{model_id}", f"runs:/{run.info.run_id}/model"):
        assert load_init_model(source, tracking_uri=uri).digest == digest, source

    tuned = tmp_path / "tuned"
    train_in_process(yesno_data, tuned, {**STEPS, INIT_FROM: "models:/yesno-base/1"}, uri)
    runs = client.search_runs([run.info.experiment_id], "tags.`asrflow.init_from` = 'models:/yesno-base/1'")
    assert [r.data.tags["asrflow.init_digest"] for r in runs] == [digest]
    assert runs[0].data.tags["asrflow.init_head"] == "loaded"


class StopAfter(TrainObserver):
    def __init__(self, step: int):
        self.step = step

    def after_step(self, run, result) -> None:
        if result.step == self.step:
            run.stop.request()


def test_an_unfinished_run_refuses_a_changed_start_model(yesno_data, tmp_path, uri):
    path = tmp_path / "base.pt"
    tiny_bundle(path, yesno_data / "lang", seed=1)
    overrides = {**STEPS, INIT_FROM: str(path)}
    faulty_tiny_trainer(yesno_data, tmp_path / "exp", overrides, uri, observers=[StopAfter(2)]).run()
    tiny_bundle(path, yesno_data / "lang", seed=2)  # same path, other weights
    with pytest.raises(AsrflowError, match="unfinished run .* init.digest"):
        faulty_tiny_trainer(yesno_data, tmp_path / "exp", overrides, uri).run()


@pytest.mark.slow
def test_resume_with_a_start_model_is_bit_identical(yesno_data, start, tmp_path):
    path, _ = start
    overrides = {
        **OVERRIDES,
        "train.optim.epochs": 2,
        INIT_FROM: str(path),
        "train.finetune.freeze_encoder_steps": 3,
        "train.finetune.encoder_lr_scale": 0.5,
    }
    reference = tmp_path / "reference"
    run_training(
        yesno_data,
        reference,
        overrides,
        log_path=tmp_path / "reference.log",
        tracking_uri=fresh_mlflow_store(reference),
    )
    exp, uri = tmp_path / "exp", fresh_mlflow_store(tmp_path / "exp")
    process = TrainingProcess(
        yesno_data, exp, overrides, log_path=tmp_path / "first.log", pause_after_step=5, tracking_uri=uri
    )
    process.wait_paused()
    process.kill()
    log = run_training(yesno_data, exp, overrides, log_path=tmp_path / "resume.log", tracking_uri=uri)
    assert resumed_from(log) == 4 and "initialised from" not in log
    assert_identical(final_state(exp), final_state(reference))


@pytest.mark.parametrize("key, value", [("freeze_encoder_steps", 2), ("encoder_lr_scale", 0.5)])
def test_a_config_without_a_model_refuses_finetune_keys(key, value):
    finetune = tiny_settings().train.finetune
    assert finetune.init_from is None
    with pytest.raises(AsrflowError, match="train.finetune.init_from"):
        replace(finetune, **{key: value})
    with pytest.raises(AsrflowError, match="train.finetune.init_from = None must name a model"):
        tiny_settings(overrides={f"train.finetune.{key}": value})
