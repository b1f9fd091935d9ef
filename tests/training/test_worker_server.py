"""Data workers forked from a forkserver (``run.mp_start_method: forkserver``, the default): the server starts
when the training data is built, before the model, and imports torch while the model is built; its
workers give the batches spawned workers give; the server outlives a SIGTERM sent to every process of the
job (the training process finishes its step with its workers), and a killed training process takes the
server and its workers with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.support.processes import running
from tests.support.repo import REPO

#: Run in a fresh process (the forkserver is one per process): build the data, look for the server among
#: this process's children, compare the first batches of forked and spawned workers, then SIGTERM the
#: server and its workers while a loader is open, take more batches and report the pids, and wait to be
#: killed.
SCRIPT = """
import json, os, signal, sys, time
import psutil, torch
from tests.support.tiny_config import tiny_train_data
from asrflow.data.loading.workers import unpack_batch

data = tiny_train_data(sys.argv[1], {"run.num_workers": 2, "run.mp_start_method": "forkserver"})
servers = [c for c in psutil.Process().children() if "forkserver" in " ".join(c.cmdline())]
deadline, torch_loaded = time.monotonic() + 120, False
while servers and not torch_loaded and time.monotonic() < deadline:
    torch_loaded = any("libtorch_cpu" in m.path for m in servers[0].memory_maps())
    time.sleep(0.2)

def first_batches(method):
    data.mp_start_method = method
    batches = data.open(0, 0)
    found = [unpack_batch(next(batches)) for _ in range(3)]
    data.close()
    return found

forked, spawned = first_batches("forkserver"), first_batches("spawn")
same = all(
    a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
    for a, b in zip(forked, spawned, strict=True)
)
data.mp_start_method = "forkserver"
batches = data.open(0, 0)
next(batches)
workers = servers[0].children()
for process in [servers[0], *workers]:
    os.kill(process.pid, signal.SIGTERM)
time.sleep(1.0)
after_sigterm = sum(1 for _ in range(4) if next(batches, None) is not None)
found = {"servers": len(servers), "torch_loaded": torch_loaded, "same": same, "after_sigterm": after_sigterm}
print(json.dumps({**found, "pids": [p.pid for p in [servers[0], *workers]]}), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_the_server_starts_with_the_data_outlives_sigterm_and_dies_with_the_training_process(yesno_data):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    trainer = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(yesno_data)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        line = trainer.stdout.readline()
        assert line, f"the script ended ({trainer.wait(timeout=60)}) before reporting"
        found = json.loads(line)
        pids = found.pop("pids")
        assert found == {"servers": 1, "torch_loaded": True, "same": True, "after_sigterm": 4}
        assert len(pids) == 3 and all(running(pid) for pid in pids), pids
        trainer.kill()
        trainer.wait(timeout=60)
        deadline = time.monotonic() + 10.0
        while any(running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in pids if running(pid)] == []
    finally:
        trainer.kill()
        trainer.wait(timeout=60)
