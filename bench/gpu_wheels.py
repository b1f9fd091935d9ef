"""The wheels a lent GPU machine needs to run ``bench.gpu_checks``: the packages it lacks, at the versions this
environment has, for its Python 3.12 on x86-64 Linux.

``python -m bench.gpu_wheels [--dest .whl] [--have FILE]``. The machine cannot reach a registry, so what it
lacks travels with the working tree (``carry: [".whl"]``) and is installed there with
``pip install --no-index --no-deps --target /tmp/site .whl/*.whl``. ``--have`` names the packages the machine's
image already holds (the device library's KINDS.md, whose "Packages:" line is read); a dependency that is there
is not fetched. Each wheel is fetched with ``--no-deps`` and its own requirements are followed here, because a
full ``pip download`` would fetch torch and CUDA again.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from bench.peer.install import PEER_VERSION
from tests.support.repo import REPO

#: What the GPU checks import that the image lacks, tracking aside.
DATA = ("lhotse", "lilcom", "soundfile", "kaldialign", "orjson", "ruamel.yaml")
#: MLflow's client alone (mlflow-skinny) with SQLAlchemy and Alembic for its SQLite store: the full mlflow
#: package would add its server's dependencies.
TRACKING = ("mlflow-skinny", "sqlalchemy", "alembic")
#: The machine's interpreter and platform, for markers and for pip's wheel tags.
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "extra": ""}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64", "any"]
KINDS = REPO.parent / ".library" / "device" / "KINDS.md"


def image_packages(path: Path) -> set[str]:
    """The package names after the last ``Packages:`` in ``path`` (comma- or space-separated), canonicalised."""
    text = path.read_text().rsplit("Packages:", 1)[-1].split("\n", 1)[0]
    return {canonicalize_name(name) for name in re.split(r"[,\s]+", text.strip(" .")) if name}


def pinned(name: str) -> str:
    """``name==version`` at this environment's version."""
    return f"{name}=={importlib.metadata.version(name)}"


def download(requirement: Requirement, dest: Path) -> Path:
    """One wheel for ``requirement`` (no dependencies) into ``dest``; its path."""
    tags = [option for platform in PLATFORMS for option in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version"]
    command += [TARGET["python_version"], "--implementation", "cp", *tags, "-d", str(dest), str(requirement)]
    subprocess.run(command, check=True)
    name = canonicalize_name(requirement.name)
    return next(w for w in dest.glob("*.whl") if canonicalize_name(w.name.split("-")[0]) == name)


def requirements_of(wheel: Path) -> list[Requirement]:
    """The ``Requires-Dist`` entries of ``wheel`` whose markers hold on the GPU machine."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    found = [Requirement(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in found if r.marker is None or r.marker.evaluate(TARGET)]


def fetch(roots: list[str], have: set[str], dest: Path) -> list[Path]:
    """Wheels for ``roots`` and every dependency not in ``have``, one version each (wheels already in ``dest``
    are removed first: two versions of a package stop the install there); the wheels fetched."""
    dest.mkdir(parents=True, exist_ok=True)
    for stale in dest.glob("*.whl"):
        stale.unlink()
    queue, seen, wheels = [Requirement(root) for root in roots], set(have), []
    while queue:
        requirement = queue.pop(0)
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        wheels.append(download(Requirement(f"{requirement.name}{requirement.specifier}"), dest))
        print(wheels[-1].name, flush=True)
        queue += requirements_of(wheels[-1])
    return wheels


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=REPO / ".whl", help="folder for the wheels (default: .whl)")
    parser.add_argument("--have", type=Path, default=KINDS, help="a file listing the image's packages")
    args = parser.parse_args(argv)
    have = image_packages(args.have)
    fetch([*(pinned(name) for name in (*DATA, *TRACKING)), f"speechbrain=={PEER_VERSION}"], have, args.dest)


if __name__ == "__main__":
    main()
