"""Every package asrflow's code imports is declared in pyproject.toml: in the dependencies, or in the extra
that the code which imports it names."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib

import pytest

from asrflow.errors import AsrflowError, require_extra
from tests.support.repo import REPO


def imported_top_levels(folder) -> set[str]:
    names: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require_extra":
                names.add(node.args[0].value.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"asrflow", "__future__"}


def declared() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {re.split(r"[\[<>=~ ;]", requirement)[0].lower().replace("_", "-") for requirement in requirements}


def test_every_package_the_code_imports_is_declared():
    distributions = importlib.metadata.packages_distributions()
    missing = {}
    for name in imported_top_levels(REPO / "asrflow") | imported_top_levels(REPO / "stages"):
        owners = {owner.lower().replace("_", "-") for owner in distributions.get(name, [name])}
        if not owners & declared():
            missing[name] = sorted(owners)
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_a_missing_optional_package_names_the_extra_to_install():
    with pytest.raises(AsrflowError) as error:
        require_extra("no_such_package_here", "onnx", "ONNX export")
    assert str(error.value) == (
        "ONNX export needs 'no_such_package_here', which is not installed: pip install 'asrflow[onnx]'"
    )
    assert require_extra("onnx", "onnx", "ONNX export").__name__ == "onnx"
