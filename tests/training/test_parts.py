"""The run's factory (asrflow.training.parts): one way to build each part, used by the stage, the tuner, the
benches and the tests; contradicting sections refused before any data is read; the tuner's measuring
processes set up as the train stage sets itself up."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from asrflow.errors import AsrflowError
from asrflow.training.config import TrainPaths
from asrflow.training.parts import RunPlace, build_run_parts, check_consistent
from asrflow.training.tune import MeasuringProcess, StepRunner, synthetic_batches
from tests.support.repo import REPO
from tests.support.tiny_config import tiny_bundle, tiny_params, tiny_settings, train_paths

#: The builders that only the factory (and the module that defines each) may call.
BUILDERS = {"build_model": "asrflow/model/conformer_ctc.py", "build_optimizer": "asrflow/training/step.py"}
FACTORY = "asrflow/training/parts.py"


def calls_of(source: str, name: str) -> list[int]:
    """Lines of ``source`` that call ``name(...)`` or ``X.name(...)``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called == name:
                lines.append(node.lineno)
    return lines


def trainer_data_builds(source: str) -> list[int]:
    """Lines of ``source`` that call ``TrainData.build(...)``."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "build"
        and getattr(node.func.value, "id", None) == "TrainData"
    ]


def test_calls_of_finds_direct_and_attribute_calls():
    assert calls_of("a = build_model(c)\nb = m.build_model(c)\nbuild_models(c)\n", "build_model") == [1, 2]
    assert trainer_data_builds("x = TrainData.build(c)\ny = Other.build(c)\n") == [1]


@pytest.mark.slow
def test_only_the_factory_builds_models_optimizers_and_train_data():
    offenders = []
    for folder in ("asrflow", "bench", "stages"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if any(part.startswith(".") for part in path.relative_to(REPO).parts):  # bench/.peer: the peer's install
                continue
            relative, source = str(path.relative_to(REPO)), path.read_text()
            for name, home in BUILDERS.items():
                if relative not in (home, FACTORY):
                    offenders += [f"{relative}:{line} {name}" for line in calls_of(source, name)]
            if relative != FACTORY:
                offenders += [f"{relative}:{line} TrainData.build" for line in trainer_data_builds(source)]
    assert offenders == []


def missing_data_paths(tmp_path: Path) -> TrainPaths:
    """Paths whose inputs do not exist: a part that reads data would fail on them first."""
    return train_paths(tmp_path / "no-data", tmp_path / "exp")


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        ({"train.data.speed_perturb": True}, ("train.data.speed_perturb", "features.on_the_fly")),
        (
            {"train.data.spec_augment": True, "train.data.freq_mask_width": 80, "features.num_mel_bins": 40},
            ("train.data.freq_mask_width", "features.num_mel_bins"),
        ),
    ],
)
def test_contradicting_sections_are_refused_before_any_data_is_read(tmp_path, *, overrides, keys):
    settings = tiny_settings(overrides={"features.on_the_fly": False, **overrides})
    with pytest.raises(AsrflowError) as error:
        build_run_parts(settings, missing_data_paths(tmp_path), RunPlace.single(torch.device("cpu")))
    message = str(error.value)
    assert all(key in message for key in keys) and "\n" not in message, message


def test_a_start_model_of_another_shape_is_refused_before_any_data_is_read(yesno_data, tmp_path):
    from asrflow.training.init_model import load_init_model

    tiny_bundle(tmp_path / "other.pt", yesno_data / "lang", seed=1, num_layers=2)
    settings = tiny_settings(yesno_data)
    init_model = load_init_model(str(tmp_path / "other.pt"))
    with pytest.raises(AsrflowError, match=r"train\.model\.num_layers 1 vs 2"):
        build_run_parts(settings, missing_data_paths(tmp_path), RunPlace.single(), init_model=init_model)
    check_consistent(settings)  # the sections alone agree


def test_the_tuner_steps_the_model_the_run_starts_from(yesno_data, tmp_path):
    """The tuner's model is the train stage's, weight for weight (as drawn, before a start model is loaded into
    it): same factory, same seeding, and the encoder's learning rate scaled as fine-tuning asks."""
    tiny_bundle(tmp_path / "start.pt", yesno_data / "lang", seed=1)
    finetune = {"train.finetune.init_from": str(tmp_path / "start.pt"), "train.finetune.encoder_lr_scale": 0.5}
    settings = tiny_settings(yesno_data, finetune)
    parts = build_run_parts(settings, train_paths(yesno_data, tmp_path), RunPlace.single(torch.device("cpu")))
    initial = {name: value.clone() for name, value in parts.model.state_dict().items()}
    vocab = parts.data.tokenizer.vocab_size
    parts.data.close()
    runner_model = {}

    class Recording(StepRunner):
        def step(self):
            if not runner_model:  # before the warm-up step changes the weights
                runner_model.update({name: value.clone() for name, value in self.model.state_dict().items()})
            return super().step()

    runner = Recording(settings, "fp32", synthetic_batches(8.0, settings, vocab)[:1], vocab_size=vocab)
    assert runner_model.keys() == initial.keys()
    assert all(torch.equal(runner_model[name], initial[name]) for name in initial)
    scales = [group["lr"] for group in runner.context.optimizer.param_groups]
    peaks = [group["initial_lr"] for group in parts.step_context.optimizer.param_groups]  # before the warm-up
    assert len(scales) == 2 and scales == peaks
    assert runner.context.seed == settings.seed  # dropout seeded per planned batch, as in the run


def stage_report(yesno_data: Path, folder: Path, precision: str) -> dict:
    """The ``process settings`` line the train stage logs, run as users run it (``python -m stages.train``)."""
    overrides = {"train.optim.precision": precision, "train.optim.epochs": 1, "train.data.max_duration_s": 60.0}
    params = folder / "params.yaml"
    params.write_text(yaml.safe_dump(tiny_params(yesno_data, overrides)))
    command = [sys.executable, "-m", "stages.train", "--params", str(params), "--exp", str(folder / "exp")]
    command += ["--fbank", str(yesno_data / "fbank"), "--lang", str(yesno_data / "lang")]
    env = {"PYTHONPATH": str(REPO), "MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlflow.db'}"}
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=300, env={**_env(), **env})
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"process settings: (\{.*\})", done.stderr)
    assert found, done.stderr[-3000:]
    return json.loads(found.group(1))


def _env() -> dict[str, str]:
    import os

    return {key: value for key, value in os.environ.items() if key not in ("LD_PRELOAD",)}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_tuner_measures_in_a_process_set_up_as_the_train_stage(yesno_data, tmp_path, precision):
    """Same malloc (jemalloc preloaded for bf16 where the stage would re-execute with it), mmap threshold,
    threads and primitive caches, in each precision the tuner measures."""
    settings = tiny_settings(yesno_data, {"train.optim.precision": precision})
    process = MeasuringProcess(settings, precision, batch_s=8.0, vocab_size=13)
    try:
        measured = process.report()
    finally:
        process.close()
    assert measured == stage_report(yesno_data, tmp_path, precision)
    assert measured["precision"] == precision
