"""The features stage on thousands of generated short utterances: a disk-space check before writing, and a
killed stage that leaves nothing half-written (its memory: tests/test_stage_memory.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict

import psutil
import pytest
import yaml

from asrflow.data.features.disk_space import SplitScan, check_disk_space, estimate_bytes, scan_split
from asrflow.data.features.extract import compute_features
from asrflow.data.manifests import load_cuts
from asrflow.errors import AsrflowError
from tests.support.corpora import feature_config, write_segment_manifests
from tests.support.repo import REPO


def manifests(root, train: int, **options):
    """``train`` short (0.1-0.3 s) cuts in train, 2 in dev and test; the manifests' folder."""
    folder = root / f"manifests-{train}"
    write_segment_manifests(
        folder, root / "audio", {"train": train, "dev": 2, "test": 2}, min_s=0.1, max_s=0.3, recordings=3, **options
    )
    return folder


def test_features_that_do_not_fit_the_free_space_stop_before_writing(tmp_path):
    folder = manifests(tmp_path, 200, recording_s=12.0)
    config = feature_config(num_jobs=1)
    needed = estimate_bytes([scan_split(folder, split) for split in ("train", "dev", "test")], config)
    with pytest.raises(
        AsrflowError, match=r"need about 0\.00 GiB \(x 1\.2 margin: 0\.00 GiB\).* but 0\.00 GiB are free"
    ):
        compute_features(folder, tmp_path / "fbank", config, free_bytes=needed)  # less than needed x margin
    assert not (tmp_path / "fbank").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["audio", folder.name]  # not even a temporary
    compute_features(folder, tmp_path / "fbank", config, free_bytes=int(needed * 1.21))
    written = sum(path.stat().st_size for path in (tmp_path / "fbank").iterdir())
    assert 0.5 * needed < written < needed  # the estimate is an upper bound, not a wild one


def test_the_margin_and_the_message_name_sizes_in_gib():
    scan = SplitScan(count=1_000_000, audio_s=3600.0 * 1000, multichannel=0)
    needed = estimate_bytes([scan], feature_config())
    assert 27 * 2**30 < needed < 28 * 2**30  # 1,000 hours at 100 frames/s x 80 bins x about a byte
    with pytest.raises(AsrflowError, match=r"need about 27\.\d\d GiB \(x 1\.5 margin: 40\.\d\d GiB\) in .*/out, but "):
        check_disk_space("out", needed, free_bytes=40 * 2**30, margin=1.5)
    check_disk_space("out", needed, free_bytes=40 * 2**30, margin=1.0)


def test_a_bad_margin_is_a_user_error(monkeypatch, tmp_path):
    monkeypatch.setenv("ASRFLOW_FEATURES_DISK_MARGIN", "lots")
    folder = manifests(tmp_path, 3, recording_s=2.0)
    with pytest.raises(AsrflowError, match="ASRFLOW_FEATURES_DISK_MARGIN='lots': give a number >= 0"):
        compute_features(folder, tmp_path / "fbank", feature_config(num_jobs=1))


def stage_command(folder, out, params) -> list[str]:
    return [
        sys.executable,
        "-m",
        "stages.features",
        "--params",
        str(params),
        "--manifests",
        str(folder),
        "--out",
        str(out),
    ]


@pytest.mark.slow
def test_a_killed_stage_leaves_nothing_half_written_and_a_rerun_completes(tmp_path):
    """SIGKILL in the middle of the train split's extraction by two worker processes: no output
    folder, no worker left writing, and the re-run writes the whole folder and sweeps the remains."""
    folder = manifests(tmp_path, 2000, recording_s=12.0)
    params = tmp_path / "params.yaml"
    features = feature_config(num_jobs=2, frame_shift_s=0.05, num_mel_bins=10)
    params.write_text(yaml.safe_dump({"features": asdict(features)}))
    out = tmp_path / "fbank"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    stage = subprocess.Popen(stage_command(folder, out, params), cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    storages = []
    deadline = time.monotonic() + 120
    while not any(path.stat().st_size > 10_000 for path in storages) and stage.poll() is None:
        assert time.monotonic() < deadline, "the stage wrote no features within 2 minutes"
        time.sleep(0.05)
        storages = list(tmp_path.glob(".fbank.*.tmp/fbank/train_feats/*.lca"))
    workers = psutil.Process(stage.pid).children(recursive=True)
    assert stage.poll() is None, "the stage ended before it could be killed: give it more cuts"
    assert len([w for w in workers if "spawn_main" in " ".join(w.cmdline())]) == 2
    stage.send_signal(signal.SIGKILL)
    stage.wait()
    gone, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, "extraction workers outlived the killed stage"
    assert not out.exists()
    assert [path.name for path in tmp_path.glob(".fbank.*")]  # the remains are hidden, beside the output

    rerun = subprocess.run(stage_command(folder, out, params), cwd=REPO, env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert list(tmp_path.glob(".fbank.*")) == []
    cuts = list(load_cuts(out, "train"))
    assert len(cuts) == 2000 and cuts[-1].load_features().shape[1] == 10
