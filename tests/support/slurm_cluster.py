"""A real one-node Slurm cluster on localhost, for the cluster tests (tests/cluster/) and for trying the profile.

Starts ``munged``, ``slurmctld`` and ``slurmd`` (Debian's ``slurm-wlm`` 22.05 and ``munge``) in
the foreground under this process, every file of theirs (key, sockets, state, spool, logs,
``slurm.conf``) in one private folder, so nothing under ``/etc`` or ``/run`` is touched and no
running system Slurm is disturbed. Clients (``sbatch``, ``squeue``, ``scancel``, Snakemake's
Slurm executor) find the cluster through ``SLURM_CONF``; :meth:`LocalSlurm.env` gives it.

No accounting database: ``AccountingStorageType=accounting_storage/none``. The Snakemake
executor plugin then asks ``squeue`` for job states (profile: ``status-command: squeue``), which
works because ``MinJobAge`` keeps finished jobs visible to ``squeue`` for 10 minutes.

One file outside the folder: ``/etc/slurm/slurm.conf`` becomes a symlink to the generated
config while the cluster runs (removed by :meth:`LocalSlurm.stop`). The plugin's job step
(``snakemake-executor-plugin-slurm-jobstep``) drops every ``SLURM_*`` variable but a few before
its inner ``srun``, ``SLURM_CONF`` included, so that ``srun`` reads the default path, as on a
real cluster. A real ``/etc/slurm/slurm.conf`` already there is never replaced: the start fails.

From a shell (as root; ``--install`` runs ``apt-get install slurm-wlm munge`` first; ``install``
only that, what ``make test`` does through ``.ci/install-slurm``)::

    python -m tests.support.slurm_cluster install
    python -m tests.support.slurm_cluster up /tmp/asrflow-slurm      # prints: export SLURM_CONF=...
    python -m tests.support.slurm_cluster up /tmp/asrflow-slurm --nodes 2   # two nodes (two slurmd) on this host
    python -m tests.support.slurm_cluster down /tmp/asrflow-slurm

``up`` leaves the daemons running (their pids in the folder) until ``down``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.processes import free_port, running

DAEMONS = ("munged", "slurmctld", "slurmd")
PACKAGES = ("slurm-wlm", "munge")
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 30
PARTITION = "main"
SYSTEM_CONF = Path("/etc/slurm/slurm.conf")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or started here; the message says why and what to do."""


def binaries_missing() -> list[str]:
    tools = (*DAEMONS, "mungekey", "sbatch", "squeue", "sinfo", "scancel", "scontrol")
    return [tool for tool in tools if shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]


def install(timeout_s: float = 600) -> None:
    """``apt-get install -y slurm-wlm munge`` (root only); a no-op when the tools are there."""
    if not binaries_missing():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SlurmUnavailable(
            f"Slurm is not installed ({', '.join(binaries_missing())} missing) and this is not a "
            "root shell with apt-get: install slurm-wlm and munge"
        )
    command = ["apt-get", "install", "-y", "-q", *PACKAGES]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    if result.returncode != 0:  # an empty package index: update once, then try again
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=timeout_s, env=env)
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    if result.returncode != 0 or binaries_missing():
        raise SlurmUnavailable(
            f"apt-get install {' '.join(PACKAGES)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
        )


def _node_line() -> tuple[str, str]:
    """The node's name and its real hardware, as ``slurmd -C`` reports it."""
    output = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout
    line = next((line for line in output.splitlines() if line.startswith("NodeName=")), None)
    if line is None:
        raise SlurmUnavailable(f"slurmd -C printed no NodeName= line:\n{output}")
    name = re.match(r"NodeName=(\S+)", line).group(1)
    return name, line


class LocalSlurm:
    """munged + slurmctld + slurmd on this machine, all state under ``root``.

    ``nodes`` > 1: that many Slurm nodes on this one host, each its own ``slurmd -N <name>``
    with its own port (Slurm's multiple-slurmd mode; Debian's build has it: ``scontrol show
    config`` says ``MULTIPLE_SLURMD = Yes``), each declaring the machine's whole hardware, so
    a multi-node job can be tried on one machine. Node names ``<host>-n1`` ..., address the host.
    """

    def __init__(self, root: Path, nodes: int = 1):
        self.root = Path(root).resolve()
        self.conf = self.root / "slurm.conf"
        self.processes: dict[str, subprocess.Popen] = {}
        self.nodes = nodes
        self.node_names: list[str] = []
        self.node = ""  # the first node
        self.host = ""  # this machine, as slurmd -C names it: every node's NodeAddr

    # ------------------------------------------------------------------ clients
    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment whose Slurm clients talk to this cluster."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def client(self, *args: str, timeout: float = 30, check: bool = True) -> str:
        result = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=self.env())
        if check and result.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
        return result.stdout

    # ------------------------------------------------------------------ set-up
    def write_config(self) -> None:
        for folder in ("state", "spool", "log", "run"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        host, node_line = _node_line()
        self.host = host
        hardware = re.sub(r"\s+UpTime=\S+", "", node_line)
        if self.nodes == 1:
            self.node_names = [host]
            node_lines = f"{hardware} State=UNKNOWN"
        else:
            self.node_names = [f"{host}-n{i}" for i in range(1, self.nodes + 1)]
            rest = re.sub(r"^NodeName=\S+\s*", "", hardware)
            node_lines = "\n".join(
                f"NodeName={name} NodeHostname={host} NodeAddr={host} Port={free_port()} {rest} State=UNKNOWN"
                for name in self.node_names
            )
        self.node = self.node_names[0]
        ctld_port, node_port = free_port(), free_port()
        run = self.root / "run"
        log = self.root / "log"
        self.conf.write_text(f"""\
# Generated by tests.support.slurm_cluster: one node, localhost, no accounting database.
ClusterName=asrflow
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={node_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={run}/munge.socket
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool/%n
SlurmctldPidFile={run}/slurmctld.pid
SlurmdPidFile={run}/slurmd-%n.pid
SlurmctldLogFile={log}/slurmctld.log
SlurmdLogFile={log}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# processes tracked by parent pid: no cgroup hierarchy is needed (containers, CI)
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# memory use sampled every 2 s; a job above its --mem is killed (state OUT_OF_MEMORY)
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=2
JobAcctGatherParams=OverMemoryKill
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
# finished jobs stay visible to squeue (the executor plugin's status command here) for 10 minutes
MinJobAge=600
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
MpiDefault=none
# a cancelled job's processes get SIGTERM, then SIGKILL after KillWait seconds
KillWait=60
{node_lines}
PartitionName={PARTITION} Nodes={",".join(self.node_names)} Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, *command: str) -> None:
        log = open(self.root / "log" / f"{name}.console", "ab")  # noqa: SIM115 - kept open while the daemon runs
        self.processes[name] = subprocess.Popen(
            list(command), stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True
        )
        (self.root / "run" / f"{name}.pid").write_text(str(self.processes[name].pid))
        log.close()

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Write the config, start the three daemons, wait (bounded) until the node is idle."""
        missing = binaries_missing()
        if missing:
            raise SlurmUnavailable(
                f"Slurm is not installed: {', '.join(missing)} missing "
                "(apt-get install slurm-wlm munge, or run with --install)"
            )
        self.write_config()
        self._link_system_conf()
        run = self.root / "run"
        key = self.root / "munge.key"
        if not key.exists():
            subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True, timeout=30)
        os.chmod(key, 0o600)
        self._spawn(
            "munged",
            "munged",
            "--foreground",
            "--force",
            f"--socket={run}/munge.socket",
            f"--key-file={key}",
            f"--pid-file={run}/munged.pid.own",
            f"--log-file={self.root}/log/munged.log",
            f"--seed-file={self.root}/state/munged.seed",
        )
        self._wait_for(lambda: (run / "munge.socket").exists(), "munged to open its socket", timeout_s)
        self._spawn("slurmctld", "slurmctld", "-D", "-c", "-f", str(self.conf))
        self._wait_for(
            lambda: self.client("scontrol", "ping", check=False).find("UP") >= 0,
            "slurmctld to answer scontrol ping",
            timeout_s,
        )
        if self.nodes == 1:
            self._spawn("slurmd", "slurmd", "-D", "-f", str(self.conf))
        else:
            for name in self.node_names:
                self._spawn(f"slurmd.{name}", "slurmd", "-D", "-N", name, "-f", str(self.conf))
        self._wait_for(self.node_idle, f"node(s) {','.join(self.node_names)} to be idle in sinfo", timeout_s)

    def _link_system_conf(self) -> None:
        if SYSTEM_CONF.is_symlink() and not SYSTEM_CONF.exists():
            SYSTEM_CONF.unlink()  # left by a cluster whose folder is gone
        if SYSTEM_CONF.is_symlink() and SYSTEM_CONF.resolve() == self.conf:
            return
        if SYSTEM_CONF.exists() or SYSTEM_CONF.is_symlink():
            raise SlurmUnavailable(
                f"{SYSTEM_CONF} already exists ({SYSTEM_CONF.resolve()}): this machine has a Slurm "
                "of its own; run the tests against it instead of a local test cluster"
            )
        try:
            SYSTEM_CONF.parent.mkdir(parents=True, exist_ok=True)
            SYSTEM_CONF.symlink_to(self.conf)
        except OSError as error:
            raise SlurmUnavailable(f"cannot link {SYSTEM_CONF} to {self.conf}: {error} (run as root)") from error

    def _unlink_system_conf(self) -> None:
        if SYSTEM_CONF.is_symlink() and Path(os.readlink(SYSTEM_CONF)) == self.conf:
            SYSTEM_CONF.unlink()

    def node_idle(self) -> bool:
        """Every node of the cluster is idle in sinfo."""
        listed = self.client("sinfo", "-h", "-N", "-o", "%N %T", check=False).split()
        states = dict(zip(listed[::2], listed[1::2], strict=False))
        return all(states.get(name) == "idle" for name in self.node_names)

    def _wait_for(self, condition, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise SlurmUnavailable(
                        f"{name} exited {process.returncode} while waiting for {what}:\n{self.log_tail(name)}"
                    )
            if condition():
                return
            time.sleep(0.5)
        raise SlurmUnavailable(
            f"waited {timeout_s:.0f} s for {what} in vain:\n{self.log_tail('slurmctld')}\n{self.log_tail('slurmd')}"
        )

    def log_tail(self, name: str, lines: int = 20) -> str:
        texts = []
        for path in sorted((self.root / "log").glob(f"{name}*")):
            texts.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(texts)

    # ------------------------------------------------------------------ tear-down
    def stop(self) -> None:
        """Cancel every job, then stop slurmd, slurmctld and munged (TERM, then KILL), bounded."""
        if "slurmctld" in self.processes or (self.root / "run" / "slurmctld.pid").exists():
            with contextlib.suppress(Exception):
                self.client("scancel", "--full", "--user", "root", "--signal", "KILL", check=False, timeout=10)
        for name, pid in reversed(list(self._pids())):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while running(pid) and time.monotonic() < deadline:
                if name in self.processes:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.processes[name].wait(timeout=0.2)
                else:
                    time.sleep(0.2)
            if running(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                if name in self.processes:
                    self.processes[name].wait(timeout=STOP_TIMEOUT_S)
            (self.root / "run" / f"{name}.pid").unlink(missing_ok=True)
        self.processes.clear()
        self._unlink_system_conf()

    def _pids(self):
        """(daemon, pid) in start order: munged, slurmctld, then the slurmd(s); from this object,
        or from the pid files that ``up`` left for ``down``."""
        run = self.root / "run"
        slurmds = sorted(
            {
                *(n for n in self.processes if n.startswith("slurmd")),
                *(path.name.removesuffix(".pid") for path in [*run.glob("slurmd.pid"), *run.glob("slurmd.*.pid")]),
            }
        )
        for name in ("munged", "slurmctld", *slurmds):
            if name in self.processes:
                yield name, self.processes[name].pid
            else:
                with contextlib.suppress(OSError, ValueError):
                    yield name, int((run / f"{name}.pid").read_text())

    def __enter__(self) -> LocalSlurm:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("up", "down", "install"))
    parser.add_argument("folder", type=Path, nargs="?", help="where the cluster keeps its config, state and logs")
    parser.add_argument("--install", action="store_true", help="apt-get install slurm-wlm munge first if missing")
    parser.add_argument("--nodes", type=int, default=1, help="Slurm nodes on this host, one slurmd each (default 1)")
    args = parser.parse_args(argv)
    if args.action == "install":
        try:
            install()
        except (SlurmUnavailable, subprocess.SubprocessError) as error:
            print(f"asrflow: Slurm not installed: {error}", file=sys.stderr)
            return 1
        print(f"Slurm installed: {' '.join(PACKAGES)}")
        return 0
    if args.folder is None:
        parser.error(f"{args.action} needs the cluster's folder")
    cluster = LocalSlurm(args.folder, nodes=args.nodes)
    try:
        if args.action == "down":
            cluster.stop()
            print(f"stopped the Slurm daemons of {cluster.root}")
            return 0
        if args.install:
            install()
        start = time.monotonic()
        cluster.start()
    except SlurmUnavailable as error:
        cluster.stop()
        print(f"asrflow: no local Slurm cluster: {error}", file=sys.stderr)
        return 1
    print(
        f"Slurm up in {time.monotonic() - start:.1f} s: "
        f"node(s) {','.join(cluster.node_names)} idle, partition {PARTITION}"
    )
    print(f"export SLURM_CONF={cluster.conf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
