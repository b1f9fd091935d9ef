"""One torchrun rank's real command run as the child of a tiny observer, which records how the child ended as
the kernel reports it (``waitpid``) and then ends the same way: for tests that read each rank's exit code
from the process that exited, never from a log line. Test harness only; the train stage never uses it.

Usage (what :func:`observed` builds, in place of ``-m MODULE ARGS`` on torchrun's command line)::

    python -m torch.distributed.run ... -m tests.support.exit_observer --exits DIR -- python -m MODULE ARGS

The child is started in the observer's own session and process group (torchrun gives each rank one), so a
signal torchrun sends to the rank's group reaches the child directly, a SIGKILL of the group kills both,
and the child's data workers stay in the session the tests search for leftover processes. SIGTERM and
SIGINT never end the observer: one from torchrun (its parent, which signals the whole group) is left to
the child, which has it already; one from anyone else is passed on (so one sent to the whole group by
another process reaches the child twice).
As soon as the child runs, ``DIR/rank-<RANK>.json`` holds :class:`RankExit` with ``returncode`` null;
once the child has ended (``waitpid``), its ``returncode`` as :class:`subprocess.Popen` gives it (the
exit code, or ``-N`` for signal ``N``). The observer then exits with that code, or raises that signal on
itself, so torchrun sees what the rank did.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

#: The signals that never end the observer: passed on to the child unless torchrun sent them to the whole group.
FORWARDED = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True)
class RankExit:
    """What the observer of rank ``rank`` saw: the child's ``pid``, its ``session`` (the observer's pid) and,
    once it ended, its ``returncode`` (exit code, or ``-N`` when signal ``N`` ended it; None while it runs)."""

    rank: int
    pid: int
    session: int
    returncode: int | None = None


def observed(exits: Path, python_args: list[str]) -> list[str]:
    """Arguments for torchrun that run ``python <python_args>`` under the observer, recording into ``exits``."""
    return ["-m", __name__, "--exits", str(exits), "--", sys.executable, *python_args]


def rank_exits(exits: Path) -> dict[int, RankExit]:
    """Every rank's record in ``exits`` (none for a rank whose child never started)."""
    records = (RankExit(**json.loads(path.read_text())) for path in sorted(Path(exits).glob("rank-*.json")))
    return {record.rank: record for record in records}


def _write(exits: Path, record: RankExit) -> None:
    """``record`` as ``exits/rank-<rank>.json``, replaced whole (a reader never sees half a file)."""
    path = exits / f"rank-{record.rank}.json"
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(asdict(record)))
    os.replace(partial, path)


def _end_like(returncode: int) -> None:
    """Exit with ``returncode``, or, when it is ``-N``, be ended by signal ``N`` as the child was."""
    if returncode >= 0:
        raise SystemExit(returncode)
    sig = -returncode
    with contextlib.suppress(OSError, ValueError):  # SIGKILL's action is the default and cannot be set
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal whose default action does not end a process (never one that ended a child)


def main(argv: list[str] | None = None) -> None:
    """Run the command after ``--`` as the observed child, record how it ended and end the same way."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exits", type=Path, required=True, help="folder for rank-<RANK>.json")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the rank's command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run")
    args.exits.mkdir(parents=True, exist_ok=True)

    launcher = os.getppid()
    # Blocked here and taken one at a time by sigwaitinfo, which names each sender; the child's mask is empty.
    watched = {signal.SIGCHLD, *FORWARDED}
    signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    # The signals Python ignores at start back to their default, as subprocess's restore_signals does.
    defaults = (signal.SIGPIPE, signal.SIGXFSZ)
    child = os.posix_spawnp(command[0], command, os.environ, setsigmask=(), setsigdef=defaults)
    record = RankExit(rank=int(os.environ.get("RANK", "0")), pid=child, session=os.getsid(0))
    _write(args.exits, record)
    while True:
        info = signal.sigwaitinfo(watched)
        if info.si_signo == signal.SIGCHLD:
            ended, status = os.waitpid(child, os.WNOHANG)
            if ended:
                break
        elif info.si_pid != launcher:  # torchrun signals the rank's whole group: the child has that one already
            os.kill(child, info.si_signo)
    returncode = os.waitstatus_to_exitcode(status)
    _write(args.exits, replace(record, returncode=returncode))
    _end_like(returncode)


if __name__ == "__main__":
    main()
