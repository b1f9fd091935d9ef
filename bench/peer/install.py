"""Install the pinned SpeechBrain beside the venv (``pip install --target``), never as asrflow's dependency."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests.support.repo import REPO

PEER_VERSION = "1.1.2"
#: ``ASRFLOW_PEER_REQUIREMENT`` replaces the pinned requirement (the tests name one that cannot install).
PEER = os.environ.get("ASRFLOW_PEER_REQUIREMENT", f"speechbrain=={PEER_VERSION}")
PEER_PACKAGES = (PEER, "hyperpyyaml", "ruamel.yaml", "joblib", "huggingface_hub")
PEER_DIR = REPO / "bench" / ".peer" / PEER_PACKAGES[0].replace("==", "-")


def peer_env() -> dict[str, str]:
    """The environment of the SpeechBrain process: PEER_DIR ahead of this process's own path (the venv's torch, or
    where a lent GPU machine's wheels were installed)."""
    path = [str(PEER_DIR), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def peer_import() -> tuple[str | None, str]:
    """The version of the SpeechBrain that :func:`peer_env` imports (None when it does not), and the last line the
    import wrote to stderr (why not)."""
    probe = [sys.executable, "-c", "import speechbrain; print(speechbrain.__version__)"]
    check = subprocess.run(probe, env=peer_env(), capture_output=True, text=True)
    said = (check.stderr.strip().splitlines() or ["?"])[-1]
    return (check.stdout.strip() if check.returncode == 0 else None), said


def install_peer() -> str | None:
    """Install the pinned SpeechBrain into PEER_DIR (once, and not where the environment already has it, as a lent
    GPU machine has from its wheels); None when it imports, else why not."""
    marker = PEER_DIR / ".installed"
    if not marker.is_file() and peer_import()[0] != PEER_VERSION:
        shutil.rmtree(PEER_DIR, ignore_errors=True)
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(PEER_DIR), *PEER_PACKAGES]
        done = subprocess.run(pip, capture_output=True, text=True)
        if done.returncode != 0:
            return f"pip install {' '.join(PEER_PACKAGES)} failed: {done.stderr.strip().splitlines()[-1:]}"
    version, said = peer_import()
    if version != PEER_VERSION:
        return f"speechbrain {PEER_VERSION} does not import: {f'found {version}' if version else said}"
    if PEER_DIR.is_dir():
        marker.write_text(PEER_VERSION)
    return None
