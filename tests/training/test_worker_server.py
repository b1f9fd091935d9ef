"""Data workers forked from a forkserver (``run.mp_start_method: forkserver``, the default): the server starts
when the training data is built, before the model, and imports torch while the model is built; its
workers give the batches spawned workers give."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from asrflow.testing.repo import REPO

#: Run in a fresh process (the forkserver is one per process): build the data, look for the server among
#: this process's children, then compare the first batches of forked and spawned workers.
SCRIPT = """
import json, sys, time
import psutil, torch
from asrflow.testing.tiny_config import tiny_train_data
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
print(json.dumps({"servers": len(servers), "torch_loaded": torch_loaded, "same": same}))
"""


def test_the_server_starts_with_the_data_and_its_workers_give_the_spawned_workers_batches(yesno_data):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(yesno_data)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"servers": 1, "torch_loaded": True, "same": True}, done.stderr
