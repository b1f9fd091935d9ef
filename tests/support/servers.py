"""Local HTTP servers that tests start (``mlflow ui``, ``mlflow server``, ``mlflow models serve``): calls to
them, waiting until one answers, and stopping one with everything it started.

A server is a :class:`subprocess.Popen` started with ``start_new_session=True``, so that its workers share
its process group and :func:`stop` ends them all.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

#: How long :func:`wait_healthy` waits for a server's first answer by default (seconds).
STARTUP_TIMEOUT_S = 60


def http(base: str, path: str, query: dict | None = None, body: dict | None = None) -> bytes:
    """The body of ``base + path`` (``?query`` url-encoded); a POST of ``body`` as JSON when given, else a GET."""
    url = f"{base}{path}"
    if query:
        url += "?" + urllib.parse.urlencode(query)
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read()


def api(base: str, path: str, query: dict | None = None, body: dict | None = None) -> dict:
    """:func:`http`, its answer read as JSON."""
    return json.loads(http(base, path, query, body))


def wait_healthy(base: str, server: subprocess.Popen, log: Path, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Block until MLflow's ``base/health`` answers ``OK``.

    Raises:
        RuntimeError: the server exited first, or ``timeout_s`` passed; the message holds its ``log``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server for {base} exited with {server.returncode}:\n{log.read_text()}")
        try:
            if http(base, "/health").strip() == b"OK":
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{base} not healthy after {timeout_s} s:\n{log.read_text()}")


def stop(server: subprocess.Popen) -> None:
    """Terminate the server and everything it started (its own process group)."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=15)
    with contextlib.suppress(ProcessLookupError):  # workers left behind in the group
        os.killpg(server.pid, signal.SIGKILL)
