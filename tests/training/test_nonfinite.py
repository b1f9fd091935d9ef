"""Non-finite guard: a NaN step is skipped and logged; persistent NaNs roll back, then stop.

NaNs are injected with ``train.inject_nonfinite_steps`` (the step's loss is multiplied by
NaN on every rank). Runs use the real ``Trainer`` on the prepared yesno data.

The WER check trains a tiny model that reaches a low test WER in six epochs (lr 0.01,
one or two utterances per step, no SpecAugment or dropout; about 6 % WER on the yesno test
split): a run with one NaN step must reach the clean run's WER within 5 points, both
below 20 %.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, tiny_train_config, train_paths
from train_entry import fresh_mlflow_store

from asrflow.data.batches import plan_epoch
from asrflow.data.features import FeatureConfig
from asrflow.data.manifests import load_cuts
from asrflow.errors import EXIT_USER_ERROR, AsrflowError
from asrflow.evaluation.evaluate import EvaluateConfig, evaluate
from asrflow.training.checkpoint import checkpoint_path, load_checkpoint
from asrflow.training.schedule import warmup_factor
from asrflow.training.trainer import Trainer

SEED = 42


def _train(data: Path, exp: Path, **overrides) -> dict:
    """Train ``tiny_train_config(**overrides)``; MLflow goes to ``exp/mlflow.db``."""
    config = tiny_train_config(**overrides)
    uri = fresh_mlflow_store(exp)
    return Trainer(config, FeatureConfig(), SEED, {}, train_paths(data, exp), tracking_uri=uri).run()


def _model_at(exp: Path, step: int) -> dict[str, torch.Tensor]:
    return load_checkpoint(checkpoint_path(exp / "checkpoints", step))["model"]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def _planned_batch(data: Path, epoch: int, index: int, max_duration_s: float) -> list[str]:
    """Cut ids of batch ``index`` of the epoch's global plan (one process, accum_grad 1: one step)."""
    cuts = load_cuts(data / "fbank", "train").to_eager()
    return plan_epoch(cuts, epoch, SEED, max_duration_s, tiny_train_config().num_buckets)[index]


def _bad_batches(exp: Path) -> list[dict]:
    return [json.loads(line) for line in (exp / "bad_batches.jsonl").read_text().splitlines()]


def test_nan_step_is_skipped_counted_and_logged(yesno_data, tmp_path, caplog):
    """Step 3's loss is NaN: parameters and optimizer state stay as after step 2; step 4 trains."""
    summary = _train(yesno_data, tmp_path, epochs=1, inject_nonfinite_steps=[3], checkpoint_every_steps=1,
                     validate_every_steps=0)

    assert summary["nonfinite_skipped"] == 1
    assert summary["rollbacks"] == 0
    assert summary["steps"] == 9
    before, at, after = (load_checkpoint(checkpoint_path(tmp_path / "checkpoints", s)) for s in (2, 3, 4))
    assert _same(at["model"], before["model"]), "the NaN step changed the parameters"
    adam_steps = [float(s["step"]) for s in at["optimizer"]["state"].values()]
    assert adam_steps == [float(s["step"]) for s in before["optimizer"]["state"].values()] == [2.0] * len(adam_steps)
    assert at["guard"]["total_skipped"] == 1
    assert not _same(after["model"], at["model"]), "training did not go on after the skipped step"
    assert all(torch.isfinite(v).all() for v in after["model"].values() if v.is_floating_point())

    records = _bad_batches(tmp_path)
    assert len(records) == 1
    assert records[0]["step"] == 3
    assert records[0]["loss"] == "nan"
    assert records[0]["cut_ids"] == _planned_batch(yesno_data, epoch=0, index=2, max_duration_s=30.0)
    assert "step 3: non-finite loss nan" in caplog.text


def _fast_wer_run(data: Path, exp: Path, **overrides) -> tuple[dict, float]:
    summary = _train(
        data, exp, lr=0.01, spec_augment=False, dropout=0.0, epochs=6, max_duration_s=12.0,
        checkpoint_every_steps=1000, validate_every_steps=0, **overrides,
    )
    uri = f"sqlite:///{exp / 'mlflow.db'}"  # the training run's store: evaluate logs into that run
    metrics = evaluate(exp / "model.pt", data / "fbank", exp / "eval", EvaluateConfig(), tracking_uri=uri)
    return summary, metrics["wer"]


def test_run_with_a_nan_step_reaches_the_clean_wer(yesno_data, tmp_path):
    clean_summary, clean_wer = _fast_wer_run(yesno_data, tmp_path / "clean")
    nan_summary, nan_wer = _fast_wer_run(yesno_data, tmp_path / "nan", inject_nonfinite_steps=[10])

    assert clean_summary["nonfinite_skipped"] == 0
    assert nan_summary["nonfinite_skipped"] == 1
    assert nan_summary["steps"] == clean_summary["steps"]
    assert [r["step"] for r in _bad_batches(tmp_path / "nan")] == [10]
    assert clean_wer < 0.20, f"the clean run did not learn (WER {clean_wer:.3f}); the check means nothing"
    assert nan_wer < 0.20
    assert abs(nan_wer - clean_wer) <= 0.05, (clean_wer, nan_wer)
    print(f"test WER: clean {clean_wer:.4f}, with a NaN step {nan_wer:.4f}")


# Persistent NaN from step 5 on. max_consecutive_nonfinite 3, checkpoints every 2 steps:
#   5, 6 skipped (checkpoint 6 saved), 7 skipped -> rollback 1 to step 6, lr x 0.5
#   7, 8 skipped (checkpoint 8: lr scale 0.5), 9 -> rollback 2 to step 8, lr x 0.25
#   9, 10 skipped (checkpoint 10: lr scale 0.25), 11 -> max_rollbacks (2) reached: stop.
PERSISTENT = dict(
    epochs=2, checkpoint_every_steps=2, validate_every_steps=0, max_consecutive_nonfinite=3, max_rollbacks=2,
    rollback_lr_factor=0.5, inject_nonfinite_steps=list(range(5, 19)),
)


def test_persistent_nan_rolls_back_with_lower_lr_then_stops(yesno_data, tmp_path, caplog):
    with pytest.raises(AsrflowError) as raised:
        _train(yesno_data, tmp_path, **PERSISTENT)

    log = caplog.text
    assert re.search(r"rollback 1 of at most 2: back to \S+step-00000006\.pt \(step 6\), learning rate scaled "
                     r"to 0\.5 x train\.lr", log), log
    assert re.search(r"rollback 2 of at most 2: back to \S+step-00000008\.pt \(step 8\).*0\.25 x train\.lr", log)
    assert "rollback 3" not in log
    # Each rollback restarts the count of skips in a row.
    after_first = log.split("rollback 1 of")[1]
    assert re.search(r"step 7: non-finite loss nan .* \(1 in a row\)", after_first), after_first

    # The learning rate after each rollback: scaled by rollback_lr_factor on top of the schedule.
    config = tiny_train_config(**PERSISTENT)
    for step, scale in ((6, 1.0), (8, 0.5), (10, 0.25)):
        state = load_checkpoint(checkpoint_path(tmp_path / "checkpoints", step))
        assert state["progress"]["lr_scale"] == scale
        expected = config.lr * scale * warmup_factor(step + 1, config.warmup_steps)
        assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(expected, rel=1e-9)
        # No NaN step ever changed the weights.
        assert _same(state["model"], _model_at(tmp_path, 4))

    # Every skipped step is in bad_batches.jsonl, and the guard's count agrees.
    records = _bad_batches(tmp_path)
    assert [r["step"] for r in records] == [5, 6, 7, 7, 8, 9, 9, 10, 11]
    assert load_checkpoint(checkpoint_path(tmp_path / "checkpoints", 10))["guard"] == {
        "total_skipped": 8, "rollbacks": 2,
    }

    message = str(raised.value)
    assert "non-finite" in message and "train.max_rollbacks" in message
    assert str(tmp_path / "bad_batches.jsonl") in message
    last_batch = records[-1]["cut_ids"]
    assert last_batch == _planned_batch(yesno_data, epoch=1, index=1, max_duration_s=30.0)  # step 11
    assert ",".join(last_batch[:5]) in message


def test_persistent_nan_stage_exits_2_without_traceback(yesno_data, tmp_path):
    """The train stage as a user runs it: one clear error line, exit 2, checkpoints kept."""
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    for name in ("fbank", "lang"):
        (work / "data" / name).symlink_to(yesno_data / name)
    config = tiny_train_config(**{**PERSISTENT, "max_rollbacks": 1})
    params = {"seed": SEED, "features": {}, "train": asdict(config)}
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    env = {
        **os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "MLFLOW_TRACKING_URI": fresh_mlflow_store(work), "GIT_PYTHON_REFRESH": "quiet",
    }
    done = subprocess.run(
        [sys.executable, "-m", "stages.train", "--params", "params.yaml", "--exp", "exp"],
        cwd=work, env=env, capture_output=True, text=True, timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == EXIT_USER_ERROR, output
    assert "Traceback" not in output
    assert "rollback 1 of at most 1" in output
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output
    assert "training stopped" in errors[0] and "bad_batches.jsonl" in errors[0]
    assert (work / "exp" / "bad_batches.jsonl").is_file()
    assert checkpoint_path(work / "exp" / "checkpoints", 6).is_file()
