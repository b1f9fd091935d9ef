"""Atomic outputs: whole or nothing, and no temporary left behind by a killed writer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asrflow.files import UNLOCKED_STALE_AFTER_S, atomic_path

REPO = Path(__file__).resolve().parents[1]

WRITER = """
import sys, time
from asrflow.files import atomic_path
with atomic_path(sys.argv[1]) as tmp:
    tmp.mkdir()
    (tmp / "feats.bin").write_bytes(b"x" * 100_000)
    print("writing", flush=True)
    time.sleep(120)
"""


def start_writer(final: Path) -> subprocess.Popen:
    """A real process inside ``atomic_path(final)``, returned once its temporary folder is written."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(final)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "writing"
    return writer


def temporaries(final: Path) -> list[Path]:
    return sorted(final.parent.glob(f".{final.name}.*.tmp"))


def test_failed_write_leaves_the_old_output(tmp_path):
    final = tmp_path / "out.txt"
    final.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(final) as tmp:
        tmp.write_text("half")
        raise RuntimeError("boom")
    assert final.read_text() == "old"
    assert temporaries(final) == []


def test_temporary_of_a_killed_writer_is_swept_by_the_next_run(tmp_path):
    final = tmp_path / "fbank"
    writer = start_writer(final)
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    assert len(temporaries(final)) == 1  # what kill -9 leaves

    with atomic_path(final) as tmp:
        tmp.mkdir()
        (tmp / "done").write_text("ok")
    assert (final / "done").read_text() == "ok"
    assert temporaries(final) == []


def test_temporary_of_a_live_writer_is_left_alone(tmp_path):
    final = tmp_path / "fbank"
    writer = start_writer(final)
    try:
        live = temporaries(final)
        with atomic_path(final) as tmp:
            tmp.mkdir()
        assert temporaries(final) == live and (live[0] / "fbank" / "feats.bin").is_file()
    finally:
        writer.kill()
        writer.wait()


def test_only_temporaries_of_the_same_output_name_are_swept(tmp_path):
    final = tmp_path / "fbank"
    others = [tmp_path / name for name in (".fbank.old.abcd1234.tmp", ".fbank2.abcd1234.tmp", ".fbank.abcd1234.keep")]
    stale = tmp_path / ".fbank.abcd1234.tmp"  # left by a writer that died before taking its lock
    fresh = tmp_path / ".fbank.efgh5678.tmp"  # a writer that may be about to take it
    for folder in [*others, stale, fresh]:
        folder.mkdir()
    old = time.time() - 2 * UNLOCKED_STALE_AFTER_S
    os.utime(stale, (old, old))
    for folder in others:
        os.utime(folder, (old, old))

    with atomic_path(final) as tmp:
        tmp.write_text("x")
    assert not stale.exists()
    assert fresh.is_dir() and all(folder.is_dir() for folder in others)
