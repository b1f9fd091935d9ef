"""Running Snakemake and DVC in temporary copies of the repository, and reading what they say.

Every command runs with a timeout, the virtual environment's tools first on PATH, and the
copy's own MLflow store, so nothing hangs and nothing touches the working repository.
The end-to-end tests (tests/pipeline/, tests/cluster/) use it; a copy comes from
:func:`tests.support.repo.copy_repo`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from tests.support.processes import ChildProcess
from tests.support.repo import tool_env

VENV_BIN = Path(sys.executable).parent
STAGES = ("prepare", "features", "tokenizer", "train", "evaluate")
# DVC's always_changed stage, run before the others every time; Snakemake runs its command while
# reading the workflow (workflow/rules/common.smk), so it is no rule there.
LISTING = "corpus_listing"
LISTING_FILE = "data/corpus_listing.tsv"

# Every file the pipeline must leave behind, whichever tool ran it.
EXPECTED_OUTPUTS = (
    "data/fbank/cmvn.json",
    "data/fbank/train_cuts.jsonl.gz",
    "data/fbank/dev_cuts.jsonl.gz",
    "data/fbank/test_cuts.jsonl.gz",
    "exp/model.pt",
    "exp/plots/train_loss.csv",
    "exp/eval/metrics.json",
    "exp/eval/per_utterance.jsonl",
    "exp/eval/errors.txt",
    "exp/eval/wer_by_duration.csv",
)
# Folders the stages write; their whole content is compared between the tools.
OUTPUT_DIRS = ("data/manifests", "data/fbank", "data/lang", "exp")

IDENTITY = ["-c", "user.name=asrflow tests", "-c", "user.email=tests@asrflow.invalid", "-c", "commit.gpgsign=false"]


class ToolError(AssertionError):
    """A tool run that failed, with the command, its exit status and the end of its output."""


def run(
    copy: Path, *args: str, timeout: float = 120, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``args`` in ``copy`` as a :class:`ChildProcess` (a session of its own, killed whole on timeout, on
    Ctrl-C, and of what is left when it exits: a stage's data-loader workers); stdout and stderr come back
    together in ``.stdout``."""
    with tempfile.TemporaryDirectory(prefix="asrflow-tool-") as logs:
        child = ChildProcess(list(args), log_path=Path(logs) / "output.log", env=env or tool_env(copy), cwd=copy)
        try:
            code = child.wait(timeout=timeout)
        except TimeoutError:
            raise ToolError(f"{' '.join(args)} ran past {timeout} s in {copy}:\n{tail(child.log())}") from None
        except BaseException:  # Ctrl-C in pytest: do not leave the tool running on its own
            child.kill()
            raise
        result = subprocess.CompletedProcess(list(args), code, child.log())
    if check and result.returncode != 0:
        raise ToolError(f"{' '.join(args)} exited {result.returncode} in {copy}:\n{tail(result.stdout)}")
    return result


def tail(text: str | bytes | None, lines: int = 60) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])


def git_init(copy: Path) -> None:
    """Make ``copy`` a git repository with one commit (DVC and Snakemake both expect one)."""
    run(copy, "git", "init", "-q")
    run(copy, "git", *IDENTITY, "add", "-A")
    run(copy, "git", *IDENTITY, "commit", "-q", "-m", "asrflow test copy")


def dvc_init(copy: Path, config: Path) -> None:
    """``dvc init`` in ``copy``, then the repository's own .dvc/config (``config``) if it has one."""
    run(copy, "dvc", "init", "-q")
    if config.is_file():
        shutil.copyfile(config, copy / ".dvc" / "config")
    run(copy, "git", *IDENTITY, "add", "-A")
    run(copy, "git", *IDENTITY, "commit", "-q", "-m", "dvc init")


def output_files(copy: Path) -> set[str]:
    """Every file under the stages' output folders, as paths relative to ``copy``."""
    found = set()
    for folder in OUTPUT_DIRS:
        root = copy / folder
        if root.is_dir():
            found.update(path.relative_to(copy).as_posix() for path in root.rglob("*") if path.is_file())
    return found


def read_metrics(copy: Path) -> dict:
    return json.loads((copy / "exp/eval/metrics.json").read_text())


# ------------------------------------------------------------------ what the tools would run
def snakemake_jobs(output: str) -> set[str]:
    """The rules in Snakemake's first "Job stats" table (``all`` left out); empty when nothing to do."""
    if "Nothing to be done" in output:
        return set()
    match = re.search(r"Job stats:\n.*?\n-+\s+-+\n(.*?)\ntotal", output, re.DOTALL)
    if match is None:
        raise ToolError(f"no job stats in Snakemake's output:\n{tail(output)}")
    rules = {line.split()[0] for line in match.group(1).splitlines() if line.strip()}
    return rules - {"all"}


def snakemake_dry_run(copy: Path) -> set[str]:
    """The rules ``snakemake --dry-run`` would run now."""
    return snakemake_jobs(run(copy, "snakemake", "--dry-run", "--cores", "1", timeout=180).stdout)


def dvc_ran_stages(output: str) -> set[str]:
    """The stages DVC ran (or, with --dry, would run): its "Running stage '<name>':" lines."""
    return set(re.findall(r"^Running stage '([^']+)':", output, re.MULTILINE))


def dvc_dry_run(copy: Path) -> set[str]:
    """The stages ``dvc repro`` would run now, besides the listing it always runs.

    The listing stage runs first, for real, as every ``dvc repro`` runs it (it is cheap and
    rewrites its output only when the corpus changed). Then :func:`dvc_status` names the
    stages changed themselves, and ``dvc repro --dry --force-downstream --downstream`` those
    and everything downstream of them in DVC's graph: a dry run cannot know that a stage it
    would run changes its outputs, so without ``--force-downstream`` it leaves out the stages
    whose only change is upstream's outputs, which a real ``dvc repro`` runs. (Forcing
    downstream of the always-changed listing would name every stage.)
    """
    run(copy, "dvc", "repro", "--single-item", LISTING, timeout=180)
    changed = set(dvc_status(copy))
    if not changed:
        return set()
    forced = run(copy, "dvc", "repro", "--dry", "--force-downstream", "--downstream", *sorted(changed), timeout=180)
    return dvc_ran_stages(forced.stdout)


def dvc_json(copy: Path, *command: str) -> dict:
    """What ``dvc COMMAND --json`` prints (one line of JSON; warnings on the same pipe are skipped)."""
    output = run(copy, "dvc", *command, "--json", timeout=180).stdout
    lines = [line for line in output.splitlines() if line.startswith("{")]
    if not lines:
        raise ToolError(f"no JSON in the output of dvc {' '.join(command)} --json:\n{tail(output)}")
    return json.loads(lines[-1])


def dvc_status(copy: Path) -> dict[str, set[str]]:
    """``dvc status --json``: each stage DVC finds changed itself, with what changed.

    A changed dep appears as its path as dvc.yaml lists it (a folder dep, not the file in
    it), a params entry as ``params.yaml:<key or section>``, a changed output as
    ``out:<path>``, anything else as DVC's own words. Stages that are only downstream of
    a change are not listed: their deps are unchanged until upstream runs; nor is the listing
    stage, which DVC finds "always changed" (the listing itself is refreshed by :func:`dvc_dry_run`).
    """
    report = dvc_json(copy, "status")
    status: dict[str, set[str]] = {}
    for stage, entries in report.items():
        if stage == LISTING and entries == ["always changed"]:
            continue
        changes = status.setdefault(stage, set())
        for entry in entries:
            if not isinstance(entry, dict):
                changes.add(str(entry))
                continue
            for kind, items in entry.items():
                for path, change in items.items():
                    if kind == "changed deps" and isinstance(change, dict):
                        changes.update(f"{path}:{key}" for key in change)
                    elif kind == "changed deps":
                        changes.add(path)
                    elif kind == "changed outs":
                        changes.add(f"out:{path}")
                    else:
                        changes.add(f"{kind}:{path}")
    return status


# ------------------------------------------------------------------ edits that are undone
@contextmanager
def edited_params(copy: Path, dotted_key: str, value) -> Iterator[None]:
    """``params.yaml`` with one key set to ``value``; the file's bytes and times come back after."""
    path = copy / "params.yaml"
    with restored(path):
        set_params(copy, {dotted_key: value})
        yield


def set_params(copy: Path, changes: dict) -> None:
    """Set ``{"section.key": value}`` in the copy's params.yaml (each must exist and change)."""
    path = copy / "params.yaml"
    params = yaml.safe_load(path.read_text())
    for dotted_key, value in changes.items():
        node = params
        *parents, last = dotted_key.split(".")
        for part in parents:
            node = node[part]
        assert last in node, f"params.yaml has no {dotted_key}"
        assert node[last] != value, f"{dotted_key} is already {value!r}"
        node[last] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False))


@contextmanager
def appended_comment(path: Path) -> Iterator[None]:
    """A source file with a comment appended (new content, new mtime); restored after."""
    with restored(path):
        with open(path, "a") as handle:
            handle.write("\n# edited by tests/pipeline: any change to the code must re-run the stage\n")
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))
        yield


@contextmanager
def restored(path: Path) -> Iterator[None]:
    """Put back ``path``'s bytes and access/modification times, whatever happens inside."""
    original = path.read_bytes()
    stat = path.stat()
    try:
        yield
    finally:
        path.write_bytes(original)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


# ------------------------------------------------------------------ each tool's view of the stages
_SNAKEMAKE_VIEW = """
import json, sys
from pathlib import Path
from snakemake.api import SnakemakeApi
from snakemake.settings.types import OutputSettings, ResourceSettings, WorkflowSettings
from snakemake_interface_executor_plugins.settings import ExecMode
with SnakemakeApi(OutputSettings()) as api:
    workflow = api.workflow(
        resource_settings=ResourceSettings(),
        workflow_settings=WorkflowSettings(exec_mode=ExecMode[sys.argv[2]]),
        snakefile=Path("workflow/Snakefile"),
        workdir=Path.cwd(),
    )._workflow
    view = {
        rule.name: {
            "params": {key: value(None) if callable(value) else value for key, value in rule.params.items()},
            "threads": rule.resources["_cores"].value,
        }
        for rule in workflow.rules
    }
Path(sys.argv[1]).write_text(json.dumps(view))
"""

_DVC_VIEW = """
import json, sys
from pathlib import Path
from dvc.dependency.param import ParamsDependency
from dvc.repo import Repo
view = {}
with Repo(str(Path.cwd()), uninitialized=True) as repo:
    for stage in repo.index.stages:
        view[stage.name] = {
            "cmd": stage.cmd,
            "deps": [dep.def_path for dep in stage.deps if not isinstance(dep, ParamsDependency)],
            "params": {dep.def_path: list(dep.params) for dep in stage.deps if isinstance(dep, ParamsDependency)},
            "outs": {out.def_path: {"persist": out.persist, "cache": out.use_cache} for out in stage.outs},
            "always_changed": stage.always_changed,
        }
Path(sys.argv[1]).write_text(json.dumps(view))
"""


def _python_view(copy: Path, script: str, name: str, *args: str) -> dict:
    target = copy.parent / f"{name}.json"
    run(copy, "python", "-c", script, str(target), *args, timeout=180)
    return json.loads(target.read_text())


def snakemake_rules_view(copy: Path, mode: str = "DEFAULT") -> dict[str, dict]:
    """Each rule's ``params`` and ``threads`` as Snakemake evaluates them (its Python API), by rule name;
    ``mode`` is Snakemake's execution mode (``DEFAULT``: the main process; ``REMOTE``: a Slurm job's own)."""
    return _python_view(copy, _SNAKEMAKE_VIEW, "snakemake_view", mode)


def snakemake_rule_params(copy: Path, mode: str = "DEFAULT") -> dict[str, dict]:
    """Each rule's ``params:`` as Snakemake evaluates them (:func:`snakemake_rules_view`), by rule name."""
    return {name: rule["params"] for name, rule in snakemake_rules_view(copy, mode).items()}


def dvc_stages(copy: Path) -> dict[str, dict]:
    """Each stage as DVC loads it from dvc.yaml (templates resolved): cmd, deps, params, outs.

    Works in a copy without ``dvc init`` too, so both tools' views come from the same files.
    """
    return _python_view(copy, _DVC_VIEW, "dvc_view")


def snakemake_dry_run_rules(copy: Path) -> dict[str, dict]:
    """``snakemake --dry-run --forceall --printshellcmds``: each rule's input, output, log and shell command."""
    output = run(copy, "snakemake", "--dry-run", "--forceall", "--printshellcmds", "--cores", "1", timeout=180).stdout
    rules: dict[str, dict] = {}
    current = None
    for line in output.splitlines():
        header = re.match(r"^(?:local)?rule (\w+):$", line)
        if header:
            current = rules.setdefault(header.group(1), {"input": [], "output": [], "log": [], "shell": None})
            continue
        if current is None:
            continue
        field = re.match(r"^\s+(input|output|log): (.*)$", line)
        if field:
            current[field.group(1)] = [part.strip() for part in field.group(2).split(", ")]
        elif line.startswith("Shell command: "):
            shell = line[len("Shell command: ") :]
            current["shell"] = None if shell == "None" else shell
            current = None
    return rules
