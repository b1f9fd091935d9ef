"""How a training process ends when something outside its own code fails, and with which exit code.

=====  ==============================================================================
code   meaning
=====  ==============================================================================
0      training finished
2      a mistake the user can fix (bad param, missing input, mismatched nodes)
70     another rank failed or vanished (a collective broke or timed out); run again to resume
71     a data worker of this rank died (often the kernel's out-of-memory killer)
75     stopped by SIGTERM/SIGINT after saving a checkpoint; run again to resume
124    no step finished within ``train.stall_timeout_s`` (every thread's stack was printed)
=====  ==============================================================================
"""

from __future__ import annotations

import torch.distributed

EXIT_PEER_FAILED = 70
EXIT_WORKER_DIED = 71

#: Words in the messages of gloo and NCCL errors that mean a peer is gone or late.
_COLLECTIVE_SIGNS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "broken pipe")


def describe_failure(error: BaseException, *, distributed: bool) -> tuple[int, str] | None:
    """``(exit code, one-line cause)`` for a failure of the job around this process, or None for any other
    error (a bug, which keeps its traceback)."""
    text = str(error)
    # A worker killed mid-transfer resets the pipe the loader reads from; one killed between batches
    # is reported by the DataLoader itself. The loop reads no other pipe or socket of its own.
    lost_pipe = isinstance(error, ConnectionResetError | BrokenPipeError | EOFError)
    if lost_pipe or (isinstance(error, RuntimeError) and "DataLoader worker" in text):
        cause = f"{type(error).__name__}: {text}" if lost_pipe else text.splitlines()[0]
        return EXIT_WORKER_DIED, (
            f"a data worker died ({cause}); look for the out-of-memory killer in the kernel log (dmesg), "
            "lower train.num_workers or train.max_duration_s"
        )
    if not distributed:
        return None
    lowered = text.lower()
    if isinstance(error, torch.distributed.DistError) or (
        isinstance(error, RuntimeError) and any(sign in lowered for sign in _COLLECTIVE_SIGNS)
    ):
        return EXIT_PEER_FAILED, (
            f"a collective with the other ranks failed ({text.splitlines()[0][:300]}): "
            "another rank failed, stalled or was killed (its own message says which)"
        )
    return None
