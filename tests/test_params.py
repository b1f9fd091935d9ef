"""Wrong params end every stage with one clear line naming the key, exit code 2, no traceback.

Each case writes the shipped params.yaml with one key broken and runs the stage's real
entry point (``main()`` in this process; one case through ``python -m`` as a user would).
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asrflow.errors import EXIT_USER_ERROR, AsrflowError
from asrflow.params import read_seed
from asrflow.testing.repo import write_shipped_params

REPO = Path(__file__).resolve().parents[1]


def write_params(tmp_path: Path, key: str, value) -> Path:
    """The shipped params with one dotted key set (or a whole section replaced)."""
    return write_shipped_params(tmp_path, {key: value})


def stage_args(stage: str, params: Path, tmp_path: Path) -> list[str]:
    """Arguments that point every input and output of ``stage`` into ``tmp_path``."""
    outputs = {
        "prepare": ["--out", str(tmp_path / "manifests")],
        "features": ["--manifests", str(tmp_path / "manifests"), "--out", str(tmp_path / "fbank")],
        "tokenizer": ["--manifests", str(tmp_path / "manifests"), "--out", str(tmp_path / "lang")],
        "train": ["--fbank", str(tmp_path / "fbank"), "--lang", str(tmp_path / "lang"), "--exp", str(tmp_path / "exp")],
        "evaluate": [
            "--model",
            str(tmp_path / "exp" / "model.pt"),
            "--fbank",
            str(tmp_path / "fbank"),
            "--out",
            str(tmp_path / "eval"),
        ],
    }
    return ["--params", str(params), *outputs[stage]]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


CASES = [
    ("prepare", "prepare", [1, 2], r"section prepare = \[1, 2\] must be a mapping"),
    ("prepare", "prepare.text", "upper", "section prepare.text = 'upper' must be a mapping"),
    ("prepare", "seed", "abc", "seed = 'abc' must be an integer"),
    ("prepare", "prepare.corpora", [{"name": "a"}, {"name": "a"}], "prepare.corpora names 'a' twice"),
    ("prepare", "prepare.corpora", [{"corpus": "folder"}], r"prepare.corpora\[0\]: name = None; each corpus needs"),
    ("prepare", "prepare.corpora", [{"name": "a/b"}], r"prepare.corpora\[0\]: name = 'a/b'; each corpus needs"),
    ("prepare", "prepare.corpora", [{"name": "a", "weight": 2}], r"\(a\): weight belongs to training.*corpus_weights"),
    ("prepare", "prepare.corpora", [{"name": "a", "sampling_rate": 8000}], "sampling_rate is a features setting"),
    ("prepare", "prepare.corpora", {"name": "a"}, "prepare.corpora = .* has the wrong type"),
    ("prepare", "prepare.corpora", [{"name": "a", "dev_fraction": 2}], r"corpora\[0\] \(a\): prepare.dev_fraction = 2"),
    ("features", "features", "abc", "section features = 'abc' must be a mapping"),
    ("features", "features.num_mel_bins", 0, "features.num_mel_bins = 0 must be at least 4"),
    ("features", "features.sampling_rate", 0, "features.sampling_rate = 0 must be greater than 0"),
    ("features", "features.num_jobs", -1, "features.num_jobs = -1 must be at least 0"),
    ("features", "features.frame_shift_s", 0, "features.frame_shift_s = 0 must be greater than 0"),
    ("tokenizer", "tokenizer.vocab_size", 0, "tokenizer.vocab_size = 0 must be at least 3"),
    ("tokenizer", "tokenizer.model_type", "wordpiece", "tokenizer.model_type = 'wordpiece' is not valid"),
    ("train", "train.model.num_heads", 5, r"train.model.num_heads \(5\) must divide train.model.d_model \(144\)"),
    ("train", "train.data.noise_snr_db", [10], r"train.data.noise_snr_db = \[10\] must be two numbers"),
    ("train", "train.data.noise_snr_db", [20, 10], r"train.data.noise_snr_db = \[20, 10\] .* low <= high"),
    ("train", "train.data.noise_snr_db", ["loud", 10], "train.data.noise_snr_db = .* has the wrong type"),
    ("train", "train.data.corpus_weights", {"a": 0}, r"train.data.corpus_weights.a = 0 must be a number > 0"),
    ("train", "train.data.corpus_weights", {"b": -1.5}, r"train.data.corpus_weights.b = -1.5 must be a number > 0"),
    ("train", "train.optim.lr", -0.001, "train.optim.lr = -0.001 must be greater than 0"),
    ("train", "train.optim.epochs", 0, "train.optim.epochs = 0 must be at least 1"),
    ("train", "train.optim.accum_grad", 0, "train.optim.accum_grad = 0 must be at least 1"),
    ("train", "run.num_workers", -1, "run.num_workers = -1 must be at least 0"),
    ("train", "run.num_workers", "many", "run.num_workers = 'many' must be auto or an integer >= 0"),
    ("train", "train.optim.precision", "fp8", "train.optim.precision = 'fp8' is not valid; use one of auto"),
    ("train", "train.model.conv_kernel_size", 14, "train.model.conv_kernel_size = 14 must be odd"),
    ("train", "run.node_rank", 1, r"run.node_rank = 1 must be below run.nnodes \(1\)"),
    ("evaluate", "evaluate", "abc", "section evaluate = 'abc' must be a mapping"),
    ("evaluate", "evaluate.decoder", "viterbi", "evaluate.decoder = 'viterbi' is not valid; use one of greedy, beam"),
    ("evaluate", "evaluate.beam_size", 0, "evaluate.beam_size = 0 must be at least 1"),
    ("evaluate", "evaluate.beam_size", 2.5, "evaluate.beam_size = 2.5 has the wrong type"),
    ("evaluate", "evaluate.max_batch_duration_s", 0, "evaluate.max_batch_duration_s = 0 must be greater than 0"),
    ("evaluate", "evaluate.lm_weight", -1, "evaluate.lm_weight = -1 must be at least 0"),
    ("evaluate", "evaluate.word_score", float("inf"), "evaluate.word_score = inf must be a finite number"),
    ("evaluate", "evaluate.lm_path", "lm.arpa", "evaluate.lm_path = 'lm.arpa' needs evaluate.decoder: beam"),
    ("evaluate", "evaluate.beam", 8, r"unknown key\(s\) evaluate.beam; valid keys are: beam_size"),
]


@pytest.mark.parametrize(("stage", "key", "value", "message"), CASES, ids=[f"{c[1]}={c[2]!r}" for c in CASES])
def test_bad_param_ends_the_stage_with_one_line(tmp_path, capsys, *, stage, key, value, message):
    params = write_params(tmp_path, key, value)
    main = importlib.import_module(f"stages.{stage}").main
    with pytest.raises(SystemExit) as exit_info:
        main(stage_args(stage, params, tmp_path))
    assert exit_info.value.code == EXIT_USER_ERROR
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1
    assert errors[0].startswith("error: params.yaml: ")
    assert re.search(message, errors[0]), errors[0]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["params.yaml"]  # nothing written


def test_bad_param_from_the_command_line_has_no_traceback(tmp_path):
    params = write_params(tmp_path, "features.num_mel_bins", 0)
    result = subprocess.run(
        [sys.executable, "-m", "stages.features", *stage_args("features", params, tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == EXIT_USER_ERROR
    assert "Traceback" not in result.stderr
    assert error_lines(result.stderr) == ["error: params.yaml: features.num_mel_bins = 0 must be at least 4"]


@pytest.mark.parametrize("seed", ["42", 1.5, True, None, [1]])
def test_seed_must_be_an_integer(seed):
    with pytest.raises(AsrflowError, match="params.yaml: seed = .* must be an integer"):
        read_seed({"seed": seed})


def test_seed_defaults_to_zero_and_keeps_integers():
    assert read_seed({}) == 0
    assert read_seed({"seed": 42}) == 42


SHIPPED_PARAMS = ["params.yaml", *sorted(str(p.relative_to(REPO)) for p in (REPO / "presets").glob("*.yaml"))]


@pytest.mark.parametrize("name", SHIPPED_PARAMS)
def test_shipped_params_pass_every_check(name):
    from asrflow.data.features import FeatureConfig
    from asrflow.data.prepare import PrepareConfig
    from asrflow.evaluation.evaluate import EvaluateConfig
    from asrflow.params import build_config
    from asrflow.tokenizer import TokenizerConfig
    from asrflow.training.config import load_train_config

    params = yaml.safe_load((REPO / name).read_text())
    PrepareConfig.from_section(params["prepare"])
    load_train_config(params)
    configs = (
        (FeatureConfig, "features"),
        (TokenizerConfig, "tokenizer"),
        (EvaluateConfig, "evaluate"),
    )
    for cls, section in configs:
        build_config(cls, params[section], section)
    assert read_seed(params) == params["seed"]


def test_presets_have_every_key_of_params_yaml_and_no_other():
    """A preset is a whole params file: a key added to params.yaml must be added to each preset."""

    def keys(path):
        from asrflow.params import flatten

        free_form = "prepare.recipe_args"  # the recipe's own arguments differ by corpus
        return {free_form if key.startswith(free_form) else key for key in flatten(yaml.safe_load(path.read_text()))}

    shipped = keys(REPO / "params.yaml")
    presets = sorted((REPO / "presets").glob("*.yaml"))
    assert presets, "presets/real-corpus.yaml is documented in the README"
    for preset in presets:
        found = keys(preset)
        assert found == shipped, f"{preset.name}: missing {sorted(shipped - found)}, extra {sorted(found - shipped)}"


def test_node_rank_from_the_command_line_is_checked_like_the_param(tmp_path, capsys):
    """``--node-rank`` overrides run.node_rank (multi-node runs), under the same check."""
    from stages.train import main

    params = write_params(tmp_path, "run.nnodes", 2)
    with pytest.raises(SystemExit) as exit_info:
        main([*stage_args("train", params, tmp_path), "--node-rank", "2"])
    assert exit_info.value.code == EXIT_USER_ERROR
    assert error_lines(capsys.readouterr().err) == [
        "error: params.yaml: run.node_rank = 2 must be below run.nnodes (2)"
    ]


@pytest.mark.parametrize("bad", [[64], [64, 0], [64, 32, 16], [64.5, 32], [True, 32]])
def test_subsampling_channels_must_be_two_positive_integers(bad):
    from asrflow.training.config import load_train_config

    with pytest.raises(AsrflowError, match=r"train\.model\.subsampling_channels"):
        load_train_config({"train": {"model": {"subsampling_channels": bad}}})
    assert load_train_config({"train": {"model": {"subsampling_channels": None}}}).model(
        80, 13
    ).subsampling_channels == (
        144,
        144,
    )


def test_num_workers_auto_loads_in_process_with_precomputed_features(yesno_data):
    from asrflow.data.features import FeatureConfig
    from asrflow.training.config import AUTO_WORKERS_ON_THE_FLY, TrainConfig
    from asrflow.training.train_data import TrainData

    assert TrainConfig().num_workers == "auto"
    assert TrainConfig().data_workers(on_the_fly=False) == 0
    assert TrainConfig().data_workers(on_the_fly=True) == AUTO_WORKERS_ON_THE_FLY == 2
    assert TrainConfig(num_workers=3).data_workers(on_the_fly=False) == 3  # an integer is taken as it is
    config = TrainConfig(max_duration_s=24.0, epochs=1)
    data = TrainData.build(
        config, FeatureConfig(), seed=42, fbank_dir=yesno_data / "fbank", lang_dir=yesno_data / "lang"
    )
    loader = data.loader(0, 0)
    assert loader.num_workers == 0
    batch = next(iter(loader))  # built in this process
    assert batch["item"].step_cut_ids


def test_an_old_flat_train_section_names_the_new_place_of_each_key(tmp_path, capsys):
    from stages.train import main

    flat = {"lr": 0.003, "d_model": 144, "experiment": "asrflow", "checkpoint_every_steps": 50}
    params = write_params(tmp_path, "train", flat)
    with pytest.raises(SystemExit) as exit_info:
        main(stage_args("train", params, tmp_path))
    assert exit_info.value.code == EXIT_USER_ERROR
    [line] = error_lines(capsys.readouterr().err)
    for moved in (
        "train.lr -> train.optim.lr",
        "train.d_model -> train.model.d_model",
        "train.experiment -> run.experiment",
        "train.checkpoint_every_steps -> train.checkpoint.checkpoint_every_steps",
    ):
        assert moved in line


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("train.optim.d_model", "unknown key train.optim.d_model; it belongs in train.model"),
        ("train.model.no_such_key", "unknown key train.model.no_such_key; valid keys: d_model"),
        (
            "train.schedule",
            "unknown section(s) train.schedule; train: holds checkpoint, data, finetune, model, nonfinite, optim",
        ),
    ],
)
def test_a_key_outside_its_section_is_named_with_its_home(tmp_path, capsys, key, message):
    from stages.train import main

    params = write_params(tmp_path, key, {} if key == "train.schedule" else 1)
    with pytest.raises(SystemExit):
        main(stage_args("train", params, tmp_path))
    assert message in capsys.readouterr().err


def test_every_train_config_key_has_one_section():
    from dataclasses import fields

    from asrflow.training.config import KEY_SECTION, TRAIN_LAYOUT, TrainConfig

    placed = [key for keys in TRAIN_LAYOUT.values() for key in keys]
    assert len(placed) == len(set(placed))
    assert set(KEY_SECTION) == {field.name for field in fields(TrainConfig)}
