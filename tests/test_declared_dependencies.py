"""pyproject.toml declares what the code imports and nothing else, the serving side imports none of the
pipeline's tools, and constraints.txt pins every distribution the declared extras pull in to the version the
suite passed on.

tests/test_dependencies.py checks one way (every import is declared); this file checks the other (every
declared distribution is imported, or is on :data:`NOT_IMPORTED` with the reason) and the constraints.

Regenerate constraints.txt from the environment the suite passed in (``make setup``'s .venv)::

    python -m tests.test_declared_dependencies > constraints.txt
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.test_dependencies import imported_top_levels

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "constraints.txt"

#: Declared distributions that no Python file here imports, each with what uses it.
NOT_IMPORTED = {
    "lilcom": "lhotse imports it (lazily) to read and write lilcom-compressed features; lhotse does not declare it",
    "dvc": "a command: `dvc repro`, `dvc metrics show`, run by the tests and users, never imported",
    "nvidia-ml-py": "imported as pynvml by MLflow's GPU system metrics, not by asrflow",
    "pytest-timeout": "a pytest plugin: pyproject's `timeout` setting",
    "ruff": "a command: `ruff check`, `ruff format --check`",
}
#: Distributions whose imported module has another name than the distribution, when they are not installed
#: here (``packages_distributions`` names the installed ones).
MODULE_OF = {"nvidia-ml-py": "pynvml", "pyyaml": "yaml", "ruamel-yaml": "ruamel", "flashlight-text": "flashlight"}
#: The releases `make setup` names and /etc/xdg/pip caps: the constraints must hold exactly these.
TORCH_PINS = {"torch": "2.14.1", "torchaudio": "2.11.0"}
#: What `asrflow transcribe`, `asrflow export` and the pyfunc model must run without.
PIPELINE_ONLY = ("snakemake", "dvc", "matplotlib", "sqlalchemy", "scipy")
SERVING_MODULES = (
    "asrflow",
    "asrflow.cli",
    "asrflow.serving.cli",
    "asrflow.serving.bundle",
    "asrflow.serving.export",
    "asrflow.serving.inference",
    "asrflow.serving.pyfunc",
    "asrflow.serving.pyfunc_code",
    "asrflow.serving.subtitles",
    "asrflow.decoding.ctc",
    "asrflow.decoding.timing",
)


def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def requirements() -> dict[str, list[Requirement]]:
    """The declared requirements by extra ("" for the core), asrflow's own extras left out."""
    table = {"": project()["dependencies"], **project()["optional-dependencies"]}
    return {
        extra: [r for r in map(Requirement, listed) if canonicalize_name(r.name) != "asrflow"]
        for extra, listed in table.items()
    }


def declared_names() -> set[str]:
    return {canonicalize_name(r.name) for listed in requirements().values() for r in listed}


def imported_anywhere() -> set[str]:
    """Top-level module names imported by asrflow, stages, bench (not the peer toolkit's install), tests and the
    Snakemake workflow (its .smk files are Python with rules, so read line by line)."""
    names = imported_top_levels(REPO / "asrflow") | imported_top_levels(REPO / "stages")
    names |= imported_top_levels(REPO / "tests")
    for path in (REPO / "bench").rglob("*.py"):
        if ".peer" not in path.relative_to(REPO).parts:
            names |= imported_top_levels_of(path)
    for path in [REPO / "workflow" / "Snakefile", *(REPO / "workflow").rglob("*.smk")]:
        for line in path.read_text().splitlines():
            found = re.match(r"\s*(?:import|from)\s+([A-Za-z_]\w*)", line)
            if found:
                names.add(found.group(1))
    return names


def imported_top_levels_of(path: Path) -> set[str]:
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def modules_of(distribution: str) -> set[str]:
    """The top-level modules an installed distribution provides (its own name's module if not installed)."""
    provided = {
        module
        for module, owners in importlib.metadata.packages_distributions().items()
        if distribution in {canonicalize_name(owner) for owner in owners}
    }
    return provided or {MODULE_OF.get(distribution, distribution.replace("-", "_"))}


def closure(extras: set[str]) -> dict[str, str]:
    """``{distribution: installed version}`` of asrflow's requirements with these extras, transitively, as this
    environment resolved them (markers evaluated for this machine, extras followed)."""
    environment = default_environment()
    found: dict[str, str] = {}
    wanted = [(r, set(r.extras)) for extra in {"", *extras} for r in requirements().get(extra, [])]
    seen: set[tuple[str, frozenset]] = set()
    while wanted:
        requirement, its_extras = wanted.pop()
        name = canonicalize_name(requirement.name)
        if (name, frozenset(its_extras)) in seen:
            continue
        seen.add((name, frozenset(its_extras)))
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found[name] = distribution.version
        for line in distribution.requires or []:
            child = Requirement(line)
            if child.marker is None or any(
                child.marker.evaluate({**environment, "extra": extra}) for extra in {"", *its_extras}
            ):
                wanted.append((child, set(child.extras)))
    return found


def pins() -> dict[str, str]:
    pinned = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not name==version"
            pinned[canonicalize_name(name)] = version
    return pinned


def test_every_declared_distribution_is_imported_or_says_why_not():
    imported = imported_anywhere()
    unused = {name for name in declared_names() - set(NOT_IMPORTED) if not modules_of(name) & imported}
    assert not unused, f"declared in pyproject.toml but imported nowhere: {sorted(unused)} (drop, or NOT_IMPORTED)"
    assert set(NOT_IMPORTED) <= declared_names(), "NOT_IMPORTED names a distribution pyproject.toml drops"


def test_the_core_leaves_the_pipeline_tools_to_extras():
    core = {canonicalize_name(r.name) for r in requirements()[""]}
    assert not core & set(PIPELINE_ONLY), core & set(PIPELINE_ONLY)
    assert {"snakemake", "dvc", "matplotlib"} <= {canonicalize_name(r.name) for r in requirements()["pipeline"]}
    dev = {extra for r in map(Requirement, project()["optional-dependencies"]["dev"]) for extra in r.extras}
    assert dev == set(project()["optional-dependencies"]) - {"dev"}, "`make setup` (.[dev]) installs every extra"


def test_serving_imports_none_of_the_pipeline_tools():
    """Imports the serving modules in a fresh interpreter where the pipeline-only packages cannot be imported."""
    blocked = ", ".join(repr(name) for name in PIPELINE_ONLY)
    script = (
        "import sys, importlib\n"
        f"for name in ({blocked},):\n"
        "    sys.modules[name] = None\n"
        f"for module in {SERVING_MODULES!r}:\n"
        "    importlib.import_module(module)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_constraints_pin_the_torch_releases_and_every_declared_distribution():
    pinned = pins()
    for name, version in TORCH_PINS.items():
        assert pinned.get(name) == version, f"constraints.txt must pin {name}=={version}"
    missing = declared_names() - set(pinned)
    assert not missing, f"declared but not pinned in constraints.txt: {sorted(missing)}"
    for extra, listed in requirements().items():
        for requirement in listed:
            version = pinned[canonicalize_name(requirement.name)]
            assert requirement.specifier.contains(version, prereleases=True), (
                f"constraints.txt pins {requirement.name}=={version}, outside pyproject's {requirement} ({extra!r})"
            )


def test_constraints_pin_what_this_environment_installed():
    """Every distribution the extras pull in here is pinned, at the version installed (CI installs from the file,
    so a change to pyproject.toml that pulls in something new fails here until the file is regenerated)."""
    pinned = pins()
    installed = closure(set(project()["optional-dependencies"]))
    unpinned = sorted(set(installed) - set(pinned))
    assert not unpinned, f"installed for asrflow's extras, not in constraints.txt (regenerate it): {unpinned}"
    moved = {name: (pinned[name], version) for name, version in installed.items() if pinned[name] != version}
    assert not moved, f"pinned, installed: {moved} (install with -c constraints.txt, or regenerate it)"


HEADER = """\
# The versions asrflow's suite passed on: every distribution that asrflow and all its extras pull in, as
# `make setup` installed them (pip install -c constraints.txt ... -e ".[dev]"; CI does the same on a fresh clone).
#
# Made from the tested environment, not resolved afresh: `python -m tests.test_declared_dependencies`
# walks the installed requirement tree of asrflow[dev] and writes what it finds (pip freeze, filtered to that
# tree). pip-tools (or uv) would resolve again from the index, giving today's releases rather than the tested
# ones, and would have to resolve torch's CUDA wheels anew; pip's own -c needs no extra tool.
# The tree is this machine's: Linux x86-64, Python 3.11 (torch's nvidia-* CUDA packages are pinned as installed;
# on other platforms a pin for a package nobody requests is ignored).
# tests/test_declared_dependencies.py checks the file against pyproject.toml and the installed environment.
"""


def render() -> str:
    found = closure(set(project()["optional-dependencies"]))
    return HEADER + "".join(f"{name}=={version}\n" for name, version in sorted(found.items()))


if __name__ == "__main__":
    sys.stdout.write(render())
