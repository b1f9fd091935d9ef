"""A multi-node training run's rendezvous, written into params.yaml from a cluster job's allocation.

``train.nnodes`` and ``train.rdzv_endpoint`` are facts of the allocation (how many nodes the
job got, which one is first), known only once the job runs. The Slurm recipe
(``workflow/slurm/multinode.sbatch``) calls this on the job's first node, before any stage
starts::

    python -m asrflow.launch.multinode --params params.yaml --nnodes 2 --endpoint node17:29500

The two keys are edited in place, line by line inside the ``train:`` section, so the file's
comments and order stay as they are; a key already holding its value is left untouched (the
file is not rewritten, so neither DVC nor Snakemake sees a change). Both keys are operational
(``asrflow.training.config.OPERATIONAL_KEYS`` holds ``rdzv_endpoint``): an unfinished run
resumes on another allocation.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

from asrflow.errors import EXIT_USER_ERROR, AsrflowError

SECTION = "run"
_KEY_LINE = re.compile(r"^(?P<indent>[ \t]+)(?P<key>\w+):(?P<space>[ \t]*)(?P<value>[^#\n]*?)(?P<tail>[ \t]*#.*)?$")


def _scalar(value: object) -> str:
    """``value`` as one YAML scalar, as ``yaml.safe_load`` reads it back."""
    return yaml.safe_dump(value).removesuffix("...\n").strip()


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); anything else is an :class:`AsrflowError` naming it."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise AsrflowError(f"--endpoint {endpoint!r}: must be host:port, with a port from 1 to 65535")
    return host, int(port)


def set_rendezvous(params_path: Path, nnodes: int, endpoint: str) -> list[str]:
    """Set ``train.nnodes`` and ``train.rdzv_endpoint`` in ``params_path``; returns the changes made
    (``"train.nnodes: 1 -> 2"``), empty when both already held these values."""
    if nnodes < 1:
        raise AsrflowError(f"--nnodes {nnodes}: must be at least 1")
    parse_endpoint(endpoint)
    params_path = Path(params_path)
    try:
        text = params_path.read_text()
    except OSError as error:
        raise AsrflowError(f"{params_path}: cannot read it ({error.strerror})") from None
    params = yaml.safe_load(text) or {}
    train = params.get(SECTION)
    if not isinstance(train, dict):
        raise AsrflowError(f"{params_path}: no '{SECTION}:' section to set the rendezvous in")
    wanted = {"nnodes": nnodes, "rdzv_endpoint": endpoint}
    changes = [
        f"{SECTION}.{key}: {train.get(key)!r} -> {value!r}" for key, value in wanted.items() if train.get(key) != value
    ]
    if not changes:
        return []

    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if re.match(rf"^{SECTION}:\s*(#.*)?$", line)), None)
    if start is None:
        raise AsrflowError(
            f"{params_path}: the '{SECTION}:' section is not a block of 'key: value' lines; set "
            f"{SECTION}.nnodes = {nnodes} and {SECTION}.rdzv_endpoint = {endpoint} by hand"
        )
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"^[^\s#]", lines[i])), len(lines))
    indent = "  "
    for i in range(start + 1, end):
        match = _KEY_LINE.match(lines[i].rstrip("\n"))
        if not match:
            continue
        indent = match["indent"]
        if match["key"] in wanted:
            value = _scalar(wanted.pop(match["key"]))
            newline = "\n" if lines[i].endswith("\n") else ""
            lines[i] = f"{indent}{match['key']}:{match['space'] or ' '}{value}{match['tail'] or ''}{newline}"
    added = [f"{indent}{key}: {_scalar(value)}\n" for key, value in wanted.items()]
    lines[start + 1 : start + 1] = added
    new_text = "".join(lines)
    check = (yaml.safe_load(new_text) or {}).get(SECTION, {})
    if check.get("nnodes") != nnodes or check.get("rdzv_endpoint") != endpoint:
        raise AsrflowError(
            f"{params_path}: could not set {SECTION}.nnodes and {SECTION}.rdzv_endpoint in place; set "
            f"them by hand: nnodes: {nnodes}, rdzv_endpoint: {endpoint}"
        )
    temporary = params_path.with_name(params_path.name + ".tmp")
    temporary.write_text(new_text)
    temporary.replace(params_path)
    return changes


def main(argv: list[str] | None = None) -> None:
    """Exit 2 with one ``error:`` line on bad input (like the stages, without their logging)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help="params file (default: %(default)s)")
    parser.add_argument("--nnodes", type=int, required=True, help="nodes (one launch each) in the run")
    parser.add_argument("--endpoint", required=True, help="host:port of the first node's rendezvous")
    args = parser.parse_args(argv)
    try:
        changes = set_rendezvous(args.params, args.nnodes, args.endpoint)
    except AsrflowError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR) from None
    if changes:
        print(f"asrflow: {args.params}: {'; '.join(changes)}")
    else:
        print(f"asrflow: {args.params}: train.nnodes {args.nnodes}, train.rdzv_endpoint {args.endpoint} already set")


if __name__ == "__main__":
    main()
