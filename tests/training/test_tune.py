"""The machine tuner: what it reads of the CPU, what it chooses from its figures, and the preset it writes."""

from __future__ import annotations

import pytest
import yaml

from asrflow.params import with_overrides
from asrflow.training.settings import TrainingSettings
from asrflow.training.tune import SHAPES, Machine, choose, chosen_precision, main, synthetic_batches
from tests.support.tiny_config import tiny_params, tiny_settings


def test_the_machine_is_read_from_cpuinfo(tmp_path):
    zen4 = tmp_path / "zen4"
    zen4.write_text("model name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2 fma avx512f avx512_bf16 avx512_vnni\n")
    sapphire = tmp_path / "sapphire"
    sapphire.write_text(
        "model name\t: Intel(R) Xeon(R) Platinum 8488C\nflags\t\t: avx512f amx_tile amx_bf16 avx512_bf16\n"
    )
    amd, intel = Machine.here(zen4), Machine.here(sapphire)
    assert (amd.cpu, amd.flags) == ("AMD EPYC 9R14", ("avx512_bf16", "avx512f", "avx512_vnni", "avx2", "fma"))
    assert intel.flags == ("avx512_bf16", "amx_bf16", "amx_tile", "avx512f")
    assert intel.slug == "intel-xeon-platinum-8488c"
    assert Machine.here(tmp_path / "missing").flags == ()  # not Linux: no flags, never a crash


def figures(**changes) -> dict:
    found = {
        "speed_batch_s": 24.0,
        "precision_audio_s_per_s": {"fp32": 100.0, "bf16": 150.0},
        "threads_audio_s_per_s": {1: 150.0, 2: 250.0},
        "largest_batch_s": 500.0,
    }
    return found | changes


def test_a_setting_replaces_params_yaml_s_only_when_clearly_faster():
    settings = tiny_settings(overrides={"train.optim.precision": "auto", "train.optim.num_threads": 1})
    assert choose(settings, figures(), cores=2) == {"train.optim.precision": "bf16", "train.optim.num_threads": 2}
    close = figures(precision_audio_s_per_s={"fp32": 100.0, "bf16": 105.0}, threads_audio_s_per_s={1: 100.0, 2: 104.0})
    assert choose(settings, close, cores=2) == {}  # within noise: params.yaml's stay
    slower = figures(precision_audio_s_per_s={"fp32": 100.0, "bf16": 62.0}, threads_audio_s_per_s={1: 100.0})
    assert choose(settings, slower, cores=1) == {}  # auto is fp32 on the CPU: bf16 slower is never picked


def test_threads_are_swept_in_the_precision_the_preset_keeps():
    """measure_machine() sweeps thread counts in chosen_precision's answer: a precision a hair faster is not trained, so
    its threads are not the ones to measure."""
    assert chosen_precision({"fp32": 100.0, "bf16": 100.2}, "fp32") == "fp32"
    assert chosen_precision({"fp32": 100.0, "bf16": 150.0}, "fp32") == "bf16"
    assert chosen_precision({"fp32": 100.0, "bf16": 95.0}, "bf16") == "bf16"  # params.yaml's, unless clearly beaten


def test_speed_is_timed_on_as_many_shapes_as_training_meets_padded_as_it_pads():
    """A CPU's bf16 kernels are set up for each new batch shape (bench/RESULTS.md#precision-by-cpu): one
    repeated shape would time bf16 without that cost."""
    unpadded = synthetic_batches(32.0, tiny_settings(), vocab_size=32)
    assert len({batch["features"].shape[1] for batch in unpadded}) == SHAPES
    padded = synthetic_batches(32.0, tiny_settings(overrides={"train.data.pad_frames_to": 64}), vocab_size=32)
    frames = {batch["features"].shape[1] for batch in padded}
    assert 1 < len(frames) < SHAPES and all(count % 64 == 0 for count in frames)
    assert all((batch["feature_lens"] <= batch["features"].shape[1]).all() for batch in padded)


def test_workers_keep_up_with_the_step_and_the_batch_is_only_lowered():
    otf = {"features.on_the_fly": True, "run.num_workers": "auto", "train.data.max_duration_s": 30.0}
    settings = tiny_settings(overrides=otf)
    found = figures(worker_audio_s_per_s=100.0, largest_batch_s=20.4)
    chosen = choose(settings, found, cores=16)
    assert chosen["run.num_workers"] == 3  # 250 audio-s/s of steps, 20 % ahead, 100 per worker
    assert chosen["train.data.max_duration_s"] == 20.0
    assert choose(settings, found, cores=3)["run.num_workers"] == 1  # the cores the 2 threads leave
    assert "train.data.max_duration_s" not in choose(settings, figures(largest_batch_s=900.0), cores=16)


@pytest.mark.slow
def test_the_tuner_writes_a_preset_that_applies_to_params_yaml(tmp_path, capsys):
    params = tmp_path / "params.yaml"
    # a params.yaml whose precision and threads are the slowest choices, so that something wins
    slow = {"train.optim.precision": "fp16", "train.optim.num_threads": 1, "train.data.max_duration_s": 8.0}
    params.write_text(yaml.safe_dump(tiny_params(overrides=slow)))
    out = tmp_path / "machine.yaml"
    main(["--params", str(params), "--out", str(out), "--seconds", "0.3"])
    preset = yaml.safe_load(out.read_text())
    assert preset["train"]["optim"]["precision"] in ("fp32", "bf16")  # fp16 on a CPU: never the fastest
    header = out.read_text().splitlines()[:3]
    assert Machine.here().cpu in " ".join(header)
    merged = with_overrides(yaml.safe_load(params.read_text()), preset, str(out))
    TrainingSettings.from_params(merged)  # every key known, every value valid
    assert f"python -m asrflow.presets {out}" in capsys.readouterr().out
