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
import torch
import yaml

from asrflow.errors import EXIT_USER_ERROR, AsrflowError
from asrflow.params import read_seed
from tests.support.repo import write_shipped_params

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
    ("train", "train.model.num_heads", 5, r"train.model.num_heads = 5 must divide train.model.d_model \(144\)"),
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
    ("evaluate", "evaluate.device", "gpu", "evaluate.device = 'gpu' is not a device; use one of auto, cpu, cuda"),
    (
        "evaluate",
        "evaluate.beam",
        8,
        r"unknown key evaluate.beam; did you mean evaluate.beam_size\? valid keys are: beam_",
    ),
]
if not torch.cuda.is_available():  # a setting the machine cannot honour is found before any work
    CASES.append(("evaluate", "evaluate.device", "cuda", "evaluate.device = cuda, but torch .* no CUDA GPU"))


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


@pytest.mark.slow
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
    from asrflow.data.features.config import FeatureConfig
    from asrflow.data.prepare.config import PrepareConfig
    from asrflow.evaluation.evaluate import EvaluateConfig
    from asrflow.params import build_config
    from asrflow.presets import preset_params
    from asrflow.tokenizer import TokenizerConfig
    from asrflow.training.config import load_train_config

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    if name != "params.yaml":  # a preset: params.yaml with its overrides
        params = preset_params(params, REPO / name)
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


def test_presets_hold_only_the_keys_they_change():
    """A preset is overrides: every key it names is one params.yaml has, with another value."""
    from asrflow.params import flatten

    base = flatten(yaml.safe_load((REPO / "params.yaml").read_text()))
    presets = sorted((REPO / "presets").glob("*.yaml"))
    assert presets, "presets/real-corpus.yaml is documented in the README"
    for preset in presets:
        for key, value in flatten(yaml.safe_load(preset.read_text())).items():
            free_form = key.startswith("prepare.recipe_args.") and base["prepare.recipe_args"] == {}
            assert key in base or free_form, f"{preset.name}: {key} is not a params.yaml key"
            assert base.get(key) != value, f"{preset.name}: {key} = {value!r} is params.yaml's own value"


def test_applying_a_preset_writes_its_values_and_keeps_the_comments(tmp_path):
    """``python -m asrflow.presets`` changes params.yaml in place: both tools read the result."""
    from asrflow.presets import main, preset_params

    params = tmp_path / "params.yaml"
    params.write_text((REPO / "params.yaml").read_text())
    preset = REPO / "presets" / "real-corpus.yaml"
    main([str(preset), "--params", str(params)])
    written = yaml.safe_load(params.read_text())
    assert written == preset_params(yaml.safe_load((REPO / "params.yaml").read_text()), preset)
    assert written["train"]["model"]["d_model"] == yaml.safe_load(preset.read_text())["train"]["model"]["d_model"]
    comments = [line for line in (REPO / "params.yaml").read_text().splitlines() if line.lstrip().startswith("#")]
    assert all(comment in params.read_text() for comment in comments)


def test_a_preset_with_a_key_params_yaml_lacks_is_refused_and_writes_nothing(tmp_path, capsys):
    from asrflow.presets import main

    params = tmp_path / "params.yaml"
    params.write_text((REPO / "params.yaml").read_text())
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  optim:\n    lrr: 0.1\n")
    with pytest.raises(SystemExit) as stop:
        main([str(bad), "--params", str(params)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "unknown key train.optim.lrr" in err and "did you mean train.optim.lr?" in err
    assert params.read_text() == (REPO / "params.yaml").read_text()


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
    from asrflow.model.conformer_ctc import build_model
    from asrflow.params import with_overrides
    from asrflow.training.config import load_train_config
    from tests.support.repo import repo_params

    def channels(value):
        return load_train_config(with_overrides(repo_params(), {"train.model.subsampling_channels": value}, "test"))

    with pytest.raises(AsrflowError, match=r"train\.model\.subsampling_channels"):
        channels(bad)
    model = channels(None).model  # null: d_model channels each
    assert model.subsampling_channels == (144, 144)
    assert build_model(model, input_dim=80, vocab_size=13).shape["subsampling_channels"] == (144, 144)


def test_num_workers_auto_loads_in_process_with_precomputed_features(yesno_data):
    from dataclasses import replace

    from asrflow.training.config import load_run_config
    from asrflow.training.run_config import (
        AUTO_WORKERS_GPU_STORED,
        AUTO_WORKERS_ON_THE_FLY,
        AUTO_WORKERS_ON_THE_FLY_MOST,
    )
    from tests.support.repo import repo_params
    from tests.support.tiny_config import tiny_train_data

    run = load_run_config(repo_params())
    assert run.num_workers == "auto"  # the shipped value
    assert run.data_workers(on_the_fly=False) == 0
    assert run.data_workers(on_the_fly=True, usable_cores=2) == AUTO_WORKERS_ON_THE_FLY == 2
    assert run.data_workers(on_the_fly=True, usable_cores=6) == 5  # the cores, less one for the rank
    assert run.data_workers(on_the_fly=True, usable_cores=16) == AUTO_WORKERS_ON_THE_FLY_MOST == 8
    assert replace(run, nproc_per_node=4).data_workers(on_the_fly=True, usable_cores=16) == 3  # per rank
    assert run.data_workers(on_the_fly=True, gpu=True, usable_cores=16) == 8
    assert run.data_workers(on_the_fly=False, gpu=True, usable_cores=16) == AUTO_WORKERS_GPU_STORED == 4
    assert run.data_workers(on_the_fly=False, gpu=True, usable_cores=3) == 2  # the share, when it is smaller
    assert replace(run, num_workers=3).data_workers(on_the_fly=False) == 3  # an integer is taken as it is
    data = tiny_train_data(
        yesno_data, {"run.num_workers": "auto", "train.data.max_duration_s": 24.0, "train.optim.epochs": 1}
    )
    loader = data.loader(0, 0)
    assert loader.num_workers == 0
    batch = next(iter(loader))  # built in this process
    assert batch["item"].step_cut_ids


@pytest.mark.parametrize(
    ("key", "home"),
    [
        ("lr", "train.optim.lr"),
        ("d_model", "train.model.d_model"),
        ("max_duration_s", "train.data.max_duration_s"),
        ("max_consecutive_nonfinite", "train.nonfinite.max_consecutive_nonfinite"),
        ("init_from", "train.finetune.init_from"),
        ("checkpoint_every_steps", "train.checkpoint.checkpoint_every_steps"),
        ("experiment", "run.experiment"),
    ],
)
def test_an_old_flat_train_key_is_refused_naming_its_new_place(tmp_path, capsys, key, home):
    """The old flat layout (``train: {lr: ...}``) ends the stage with one line that names where the key lives."""
    from stages.train import main

    params = write_params(tmp_path, f"train.{key}", 1)
    with pytest.raises(SystemExit) as exit_info:
        main(stage_args("train", params, tmp_path))
    assert exit_info.value.code == EXIT_USER_ERROR
    assert error_lines(capsys.readouterr().err) == [
        f"error: params.yaml: unknown key train.{key}; it belongs in {home}"
    ]


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("train.optim.d_model", "unknown key train.optim.d_model; it belongs in train.model.d_model"),
        ("train.optim.lrr", "unknown key train.optim.lrr; did you mean train.optim.lr? valid keys are: accum_grad,"),
        (
            "train.model.no_such_key",
            "unknown key train.model.no_such_key; valid keys are: attention, attention_dropout, blank_bias_init, "
            "conv_kernel_size, d_model,",
        ),
        (
            "train.schedule",
            "unknown key train.schedule; valid keys are: checkpoint, data, finetune, model, nonfinite, optim",
        ),
        ("run.lr", "unknown key run.lr; it belongs in train.optim.lr"),
        (
            "run.experimnt",
            "unknown key run.experimnt; did you mean run.experiment? valid keys are: allocator, dist_timeout_s,",
        ),
    ],
)
def test_an_unknown_key_is_named_with_its_home_or_the_nearest_valid_key(tmp_path, capsys, key, message):
    from stages.train import main

    params = write_params(tmp_path, key, {} if key == "train.schedule" else 1)
    with pytest.raises(SystemExit) as exit_info:
        main(stage_args("train", params, tmp_path))
    assert exit_info.value.code == EXIT_USER_ERROR
    [line] = error_lines(capsys.readouterr().err)
    assert line.startswith(f"error: params.yaml: {message}"), line


@pytest.mark.parametrize("key", ["train.optim.lr", "train.model.d_model", "train.data.corpus_weights", "run.nnodes"])
def test_a_missing_key_is_named(tmp_path, capsys, key):
    """No dataclass default stands in for a key left out of params.yaml: the stage names it and stops."""
    from stages.train import main

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    *sections, name = key.split(".")
    section = params
    for part in sections:
        section = section[part]
    del section[name]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(SystemExit) as exit_info:
        main(stage_args("train", tmp_path / "params.yaml", tmp_path))
    assert exit_info.value.code == EXIT_USER_ERROR
    assert error_lines(capsys.readouterr().err) == [
        f"error: params.yaml: {key} missing; add it (the shipped params.yaml documents each key and its default)"
    ]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["params.yaml"]  # nothing written


def test_train_and_run_sections_mirror_params_yaml_one_to_one():
    """Each ``train:`` section is one config dataclass with exactly params.yaml's keys and no defaults of its
    own (the yaml is the only place a default lives), and no key is in two sections (so a misplaced key has
    one home to name)."""
    import dataclasses
    import typing

    from asrflow.training.config import TrainConfig
    from asrflow.training.run_config import RunConfig

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    sections = typing.get_type_hints(TrainConfig)
    assert set(sections) == set(params["train"])
    configs = {f"train.{name}": (cls, params["train"][name]) for name, cls in sections.items()}
    configs["run"] = (RunConfig, params["run"])
    placed = []
    for name, (cls, section) in configs.items():
        fields = dataclasses.fields(cls)
        assert {field.name for field in fields} == set(section), name
        defaulted = [
            f.name
            for f in fields
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        ]
        assert not defaulted, f"{name}: {defaulted} have dataclass defaults"
        if name != "run":
            placed += [field.name for field in fields]
    assert len(placed) == len(set(placed)), sorted(key for key in placed if placed.count(key) > 1)


def _plain(value):
    """``value`` as params.yaml would hold it: a dataclass as its dict, tuples as lists."""
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _defaults_not_in_params(cls, section: dict, name: str) -> list[str]:
    """Each field of ``cls`` with a dataclass default (or default_factory) that params.yaml's ``section`` lacks
    or holds another value for, as ``name.key: ...``."""
    import dataclasses

    differing = []
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            continue
        if field.name not in section:
            differing.append(f"{name}.{field.name}: default {default!r}, not in params.yaml")
        elif _plain(default) != _plain(section[field.name]):
            differing.append(f"{name}.{field.name}: default {default!r}, params.yaml {section[field.name]!r}")
    return differing


def test_every_section_default_is_params_yaml_s():
    """params.yaml is the only place a default lives: a config dataclass that keeps a default of its own (prepare
    and evaluate do, so code can build one from a few keys) holds params.yaml's value at that key, so a config
    built in code is the one users run."""
    import dataclasses
    import typing

    from asrflow.data.features.config import FeatureConfig
    from asrflow.data.prepare.config import PrepareConfig
    from asrflow.data.prepare.text import TextConfig
    from asrflow.evaluation.evaluate import EvaluateConfig
    from asrflow.tokenizer import TokenizerConfig
    from asrflow.training.config import TrainConfig
    from asrflow.training.run_config import RunConfig

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    configs = {
        "prepare": PrepareConfig,
        "prepare.text": TextConfig,
        "features": FeatureConfig,
        "tokenizer": TokenizerConfig,
        "evaluate": EvaluateConfig,
        "run": RunConfig,
        **{f"train.{name}": cls for name, cls in typing.get_type_hints(TrainConfig).items()},
    }
    differing = []
    for name, cls in configs.items():
        section = params
        for part in name.split("."):
            section = section[part]
        differing += _defaults_not_in_params(cls, section, name)
    assert not differing, f"dataclass defaults that are not params.yaml's (change one or the other): {differing}"

    shipped_beam = params["evaluate"]["beam_size"]

    @dataclasses.dataclass(frozen=True)
    class Differing:  # the check sees a default that differs, and one params.yaml lacks
        beam_size: int = shipped_beam + 1
        no_such_key: float = 1.0

    assert _defaults_not_in_params(Differing, params["evaluate"], "evaluate") == [
        f"evaluate.beam_size: default {shipped_beam + 1}, params.yaml {shipped_beam}",
        "evaluate.no_such_key: default 1.0, not in params.yaml",
    ]
