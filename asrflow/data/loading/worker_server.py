"""The forkserver the data workers are forked from (``run.mp_start_method: forkserver``): how the training
process starts it, and how it sets itself up.

The server is the training process's child and each data worker is the server's child, so the server must
behave as a worker does (see :func:`~asrflow.data.loading.workers.init_worker`): leave SIGINT and SIGTERM,
which Ctrl-C, torchrun or a scheduler send to every process of the job, to the training process, which
finishes its step and saves (a server ended by them takes the workers with it: torch's workers stop when
their parent changes); and die with the training process however it ends, ``SIGKILL`` included. Left alone,
it would outlive a killed training process with its workers: each worker holds the server's "a client is
alive" pipe open, and each watches the server, not the training process.

``multiprocessing`` runs no code of ours in the server except the imports of its preload list, so the
set-up is the import of this module, listed first; it acts only in a forkserver process.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import signal
import sys

from asrflow.process_lifetime import die_with_parent

#: What the server imports once, so that each data worker it forks starts with them loaded (torch, Lhotse):
#: this module first (its import sets the server up), then the workers' modules.
PRELOADED_MODULES = (__name__, "asrflow.data.loading.workers", "asrflow.data.loading.dataset")

#: How ``multiprocessing`` starts its forkserver: ``python -c "from multiprocessing.forkserver import main; ..."``.
_SERVER_COMMAND = "from multiprocessing.forkserver import main"


def start_worker_server() -> None:
    """Start the forkserver in the background: it imports :data:`PRELOADED_MODULES` while this process goes on
    building the model, instead of each spawned worker importing them once the loader opens. Call it from the
    main thread: the server dies when the thread that started it ends."""
    multiprocessing.set_forkserver_preload(list(PRELOADED_MODULES))
    multiprocessing.forkserver.ensure_running()


def is_worker_server() -> bool:
    """Whether this process is a ``multiprocessing`` forkserver."""
    return any(argument.startswith(_SERVER_COMMAND) for argument in sys.orig_argv)


def set_up_worker_server() -> None:
    """In the server: ignore SIGINT and SIGTERM, and be killed when the training process (its parent) ends.
    A training process that ended before this point leaves a server with no worker, which ends by itself
    once it sees no client left."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()


if is_worker_server():
    set_up_worker_server()
