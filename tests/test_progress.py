"""Progress where the user looks: under Snakemake a stage's output goes to its log file, and
the terminal (handed over as descriptor 3) shows where the log is, progress lines and warnings."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asrflow.logs import PROGRESS_LOGGER, TerminalFilter, TerminalProgress, format_duration
from tests.support.repo import REPO, copy_repo

CHILD = r"""
import logging
from asrflow.logs import TerminalProgress, setup_logging
setup_logging()
logging.getLogger("asrflow.train").info("detail only for the log file")
logging.getLogger("asrflow.tracking.run").info("MLflow run abc", extra={"terminal": True})
progress = TerminalProgress(total_steps=10, every_s=3600)
for step in range(1, 11):
    progress.update(step, epoch=0, loss=1.0 / step, audio_s_per_s=50.0)
logging.getLogger("asrflow.guard").warning("a warning")
"""


def test_step_progress_line_and_eta():
    progress = TerminalProgress(total_steps=400, start_step=100, every_s=30)
    line = progress.line(150, 12, 0.81234, 64.25, now=progress.started + 100)
    # 50 steps in 100 s: 250 steps left take 500 s.
    assert line == "step 150/400 (38%) epoch 12: loss 0.8123, 64.2 audio s/s, ETA 8m20s"
    assert TerminalProgress().line(7, 0, 2.0, 1.0) == "step 7 epoch 0: loss 2.0000, 1.0 audio s/s"
    assert format_duration(12) == "12s" and format_duration(4000) == "1h06m"


def test_step_progress_is_rate_limited(caplog):
    progress = TerminalProgress(total_steps=100, every_s=3600)
    with caplog.at_level(logging.INFO, logger=PROGRESS_LOGGER):
        shown = [progress.update(step, 0, 1.0, 10.0) for step in range(1, 101)]
    assert shown.count(True) == 2 and shown[0] and shown[-1]  # the first and the last step
    assert [r.getMessage().split(" epoch")[0] for r in caplog.records] == ["step 1/100 (1%)", "step 100/100 (100%)"]


def test_terminal_filter():
    def record(name, level, **extra):
        item = logging.LogRecord(name, level, __file__, 1, "m", (), None)
        item.__dict__.update(extra)
        return item

    keep = TerminalFilter().filter
    assert keep(record(PROGRESS_LOGGER, logging.INFO))
    assert keep(record("asrflow.train", logging.WARNING))
    assert keep(record("asrflow.tracking.run", logging.INFO, terminal=True))
    assert not keep(record("asrflow.train", logging.INFO))


def test_descriptor_3_gets_progress_and_the_log_file_everything(tmp_path):
    """The redirections of the Snakemake rules (workflow/rules/common.smk), run by bash."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "ASRFLOW_PROGRESS_FD": "3",
        "ASRFLOW_STAGE": "train",
        "ASRFLOW_LOG_FILE": "logs/train.log",
    }
    result = subprocess.run(
        ["bash", "-c", f"{sys.executable} {script} 3>&2 > {tmp_path / 'train.log'} 2>&1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    terminal = result.stderr.splitlines()
    log = (tmp_path / "train.log").read_text()
    assert "[train] running; full log in logs/train.log" in terminal[0]
    assert any("[train] MLflow run abc" in line for line in terminal)
    steps = [line for line in terminal if "step " in line]
    assert len(steps) == 2 and "step 1/10 (10%)" in steps[0] and "step 10/10 (100%)" in steps[1]
    assert "ETA" in steps[0]
    assert any("a warning" in line for line in terminal)
    assert "detail only for the log file" not in result.stderr
    assert "detail only for the log file" in log and "step 10/10" in log and "a warning" in log


def test_descriptor_of_another_file_is_not_written(tmp_path):
    """A child that inherited the variables but not the descriptor (torchrun's workers) writes
    nothing to whatever file now has that number."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(REPO), "ASRFLOW_PROGRESS_FD": "3", "ASRFLOW_PROGRESS_FD_ID": "1:1"}
    result = subprocess.run(
        ["bash", "-c", f"{sys.executable} {script} 3>{tmp_path / 'other'}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert (tmp_path / "other").read_text() == ""
    assert "detail only for the log file" in result.stderr


@pytest.mark.slow
def test_snakemake_shows_where_the_log_is(tmp_path):
    """A real Snakemake run of the prepare rule: its terminal names the log; the log has the detail."""
    copy = copy_repo(tmp_path / "repo")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{copy}/mlflow.db"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    result = subprocess.run(
        ["snakemake", "--cores", "1", "data/manifests"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "[prepare] running; full log in logs/prepare.log" in output
    log = (copy / "logs" / "prepare.log").read_text()
    assert "INFO" in log
    assert not any(" INFO " in line for line in output.splitlines()), output
