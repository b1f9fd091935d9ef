"""bench.peer_speed: a peer that cannot be installed is reported, never a ratio it did not measure.

Nothing here looks at how fast anything is (the figures live in bench/RESULTS.md#peer-speed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.peer.side import flops_by_part
from tests.support.repo import REPO


def test_flops_are_split_by_model_part():
    counts = {
        "Global": {"mm": 100, "conv": 60},
        "ConformerCtc": {"mm": 100, "conv": 60},
        "ConformerCtc.subsampling": {"conv": 50},
        "ConformerCtc.encoder.conformer_layers.0.self_attn": {"mm": 30},
        "ConformerCtc.encoder.conformer_layers.0.self_attn.out_proj": {"mm": 10},  # inside self_attn: not again
        "ConformerCtc.encoder.conformer_layers.0.conv_module": {"conv": 10},
        "ConformerCtc.encoder.conformer_layers.0.ffn1": {"mm": 20},
        "ConformerCtc.encoder.conformer_layers.0.ffn2": {"mm": 20},
        "ConformerCtc.head": {"mm": 5},
    }
    parts = flops_by_part(counts)
    assert parts == {
        "front_end": 50,
        "attention": 30,
        "convolution": 10,
        "feed_forward": 40,
        "ctc_head": 5,
        "other": 25,
    }


@pytest.mark.pipeline
def test_unavailable_peer_is_reported_and_quick_exits_zero(tmp_path):
    """~1 min: asrflow's quick run still happens; the peer's line says why it is missing and has no ratio."""
    env = {**os.environ, "GIT_PYTHON_REFRESH": "quiet", "ASRFLOW_PEER_REQUIREMENT": "speechbrain==0.0.0.dev0"}
    env.pop("MLFLOW_TRACKING_URI", None)
    done = subprocess.run(
        [sys.executable, "-m", "bench.peer_speed", "--quick", "--workdir", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    peer = [r for r in records if r["benchmark"] == "peer_speed"]
    assert peer and all(r["status"] == "peer unavailable" for r in peer), peer
    for record in peer:
        assert "speechbrain==0.0.0.dev0" in record["reason"]
        assert "ratio" not in record and "speechbrain" not in record
        assert record["asrflow"]["audio_s_per_s"] > 0


def test_the_sweep_picks_each_side_by_its_best_round():
    """A load spike in one round does not decide: 2 threads lost round 1 to a spike and wins on its best round."""
    from bench.peer.sweep import pick_settings

    best, figures = pick_settings(
        {
            ("asrflow", 1, 0): [150.0, 152.0],
            ("asrflow", 2, 0): [180.0, None],  # round 2 gave no figure
            ("speechbrain", 1, 0): [82.8, 81.0],
            ("speechbrain", 2, 0): [60.0, 113.0],
        }
    )
    assert best["asrflow"]["num_threads"] == 2 and best["asrflow"]["audio_s_per_s"] == 180.0
    assert best["speechbrain"]["num_threads"] == 2 and best["speechbrain"]["audio_s_per_s"] == 113.0
    assert [row["audio_s_per_s_of_each_round"] for row in figures["speechbrain"]] == [[82.8, 81.0], [60.0, 113.0]]


@pytest.mark.pipeline
def test_the_whole_loop_trains_speechbrains_brain_for_as_many_steps_as_asrflow(tmp_path):
    """SpeechBrain's own loop (its Brain, its data pipeline from the audio) against asrflow's Trainer: the same
    step count, speed and memory of each; no dev loss (its loop decodes instead of measuring one)."""
    from bench.peer.install import PEER_VERSION, install_peer
    from bench.peer_speed import main

    problem = install_peer()
    if problem is not None:
        pytest.skip(f"SpeechBrain {PEER_VERSION} is not available here: {problem}")
    records = main(["--quick", "--loop", "whole", "--steps", "3", "--workdir", str(tmp_path)])
    (found,) = [record for record in records if record["benchmark"] == "peer_speed"]
    assert found["loop"] == "whole"
    if found["status"] == "peer unavailable":  # installed above, then gone: said, with no ratio, and not a pass
        assert found["reason"] and "ratio" not in found, found
        pytest.skip(f"SpeechBrain {PEER_VERSION} became unavailable during the run: {found['reason']}")
    ours, theirs = found["asrflow"], found["speechbrain"]
    assert ours["steps"] == theirs["steps"] == 3
    assert theirs["audio_s_per_s"] > 0 and theirs["start_to_first_step_s"] > 0 and theirs["peak_tree_pss_mb"] > 0
    assert theirs["dev_loss"] is None and "dev_loss_no_worse" not in found
    assert found["ratio"] > 0 and "memory" in found["goal"] and isinstance(found["meets_goal"], bool)
    assert theirs["flops_per_audio_s"] is None  # the bare side counts FLOPs on its dumped batch; the Brain does not
    marks = ours["start_marks_s"]  # where asrflow's start-up goes, read from its Trainer's log
    assert list(marks)[:3] == ["data", "model", "first_batch"] and 0 < marks["first_batch"] <= marks["first_step"]
    assert marks["first_step"] == pytest.approx(ours["start_to_first_step_s"], abs=1.0)
