"""Child processes for tests and benchmarks: own session, a log file, timeouts that kill the whole
tree, the tree's peak memory, and free TCP ports."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import NamedTuple

import psutil


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie, ended but not yet reaped, counts as ended)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def tree(pid: int) -> list[psutil.Process]:
    """``pid`` and every process below it (empty once it is gone)."""
    try:
        process = psutil.Process(pid)
        return [process, *process.children(recursive=True)]
    except psutil.Error:
        return []


class MemoryReading(NamedTuple):
    """One reading of a process tree's memory, in bytes, ``at_s`` seconds after its start.

    ``pss`` splits shared pages between the processes sharing them: what the machine must hold. ``anon_pss`` is
    its anonymous part (heap, tensors, what forked workers still share with their parent): the memory the tree
    made. Libraries' file pages are left out of it: their share falls as other programs on the machine map the
    same libraries, so a figure that holds them depends on what else runs.
    """

    at_s: float
    rss: int
    pss: int
    anon_pss: int


def _rollup(pid: int) -> dict[str, int]:
    """``pid``'s ``/proc/<pid>/smaps_rollup`` as ``{field: bytes}``."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value, *_ = line.split()
        fields[name.rstrip(":")] = int(value) * 1024
    return fields


def tree_memory(pid: int, at_s: float = 0.0) -> MemoryReading:
    """The summed memory of ``pid`` and its descendants (kernels without ``Pss_Anon``: ``anon_pss`` is ``pss``)."""
    rss = pss = anon_pss = 0
    for process in tree(pid):
        with contextlib.suppress(OSError):  # a worker that just ended
            fields = _rollup(process.pid)
            rss, pss = rss + fields["Rss"], pss + fields["Pss"]
            anon_pss += fields.get("Pss_Anon", fields["Pss"]) + fields.get("Pss_Shmem", 0)
    return MemoryReading(at_s, rss, pss, anon_pss)


class ChildProcess:
    """``command`` in a session of its own (a signal reaches it and its workers), output to ``log_path``.

    With ``memory_poll_s``, a thread reads the tree's memory that often: :attr:`peak_rss`, :attr:`peak_pss` and
    :attr:`peak_anon_pss` (bytes; spikes shorter than the interval may be missed), and every reading in
    :attr:`memory_samples` (:class:`MemoryReading`). Reading PSS costs CPU (each process's smaps), so poll no
    faster than the figure needs.
    """

    def __init__(
        self,
        command: list[str],
        *,
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        memory_poll_s: float | None = None,
    ):
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.peak_rss = self.peak_pss = self.peak_anon_pss = 0
        self.memory_samples: list[MemoryReading] = []
        self.started = time.time()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        self._done = threading.Event()
        self._poller = None
        if memory_poll_s:
            self._poller = threading.Thread(target=self._poll, args=(memory_poll_s,), daemon=True)
            self._poller.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _poll(self, every_s: float) -> None:
        while not self._done.is_set() and self.process.poll() is None:
            reading = tree_memory(self.process.pid, time.time() - self.started)
            self.peak_rss, self.peak_pss = max(self.peak_rss, reading.rss), max(self.peak_pss, reading.pss)
            self.peak_anon_pss = max(self.peak_anon_pss, reading.anon_pss)
            self.memory_samples.append(reading)
            self._done.wait(every_s)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process group (the process and its workers), as a scheduler or Ctrl-C would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        """SIGKILL the group and every descendant, also those in sessions of their own (torchrun's ranks)."""
        below = [p.pid for p in tree(self.process.pid)[1:]]
        self.signal(signal.SIGKILL)
        for pid in below:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self._reap()

    def _reap(self) -> int:
        code = self.process.wait(timeout=60)
        self._done.set()
        if self._poller is not None:
            self._poller.join()
        return code

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; on a timeout the tree is killed and a ``TimeoutError`` raised. Workers left
        behind in the group are killed either way."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"{self.log_path.name}: no exit within {timeout} s:\n{self.tail()}") from None
        self.signal(signal.SIGKILL)
        return self._reap()

    def wait_at_most(self, seconds: float) -> None:
        """Block until the process ends or ``seconds`` pass, whichever comes first (nothing is killed)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=seconds)

    def wait_for(self, text: str, timeout: float = 300.0) -> None:
        """Block until ``text`` is in the log; raise ``RuntimeError`` (tree killed) if the process
        ends or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while text not in self.log():
            if self.process.poll() is not None:
                raise RuntimeError(f"exited {self.process.returncode} before {text!r}:\n{self.tail(40)}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"no {text!r} within {timeout} s:\n{self.tail(40)}")
            time.sleep(0.05)
