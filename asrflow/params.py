"""Reading ``params.yaml`` safely and turning a section into a typed, validated config."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from asrflow.errors import AsrflowError

C = TypeVar("C")


def load_params(path: str | Path = "params.yaml") -> dict[str, Any]:
    """Load the whole params file with ``yaml.safe_load``."""
    path = Path(path)
    if not path.is_file():
        raise AsrflowError(f"params file {path} not found: run from the repository root or pass --params")
    try:
        params = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise AsrflowError(f"params file {path} is not valid YAML: {error}") from None
    if not isinstance(params, dict):
        raise AsrflowError(f"params file {path} must hold a mapping of sections")
    return params


def _type_ok(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return True
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        return any(_type_ok(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        item_type = next(iter(typing.get_args(annotation)), Any)
        return all(_type_ok(item, item_type) for item in value)
    if origin is dict:
        return isinstance(value, dict)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True


def require_mapping(section: Any, name: str) -> dict[str, Any]:
    """``section`` as a dict (``{}`` when left empty); anything but a mapping is a user error."""
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise AsrflowError(
            f"params.yaml: section {name} = {section!r} must be a mapping of keys (key: value lines "
            f"indented under {name}:), or left out for the defaults"
        )
    return section


def build_config(cls: type[C], section: dict[str, Any] | None, name: str) -> C:
    """Build dataclass ``cls`` from ``params.yaml`` section ``name``.

    Unknown keys and values of the wrong type end in an :class:`AsrflowError` that names
    the key; keys left out take the dataclass defaults.
    """
    section = dict(require_mapping(section, name))
    hints = typing.get_type_hints(cls)
    fields = {field.name for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(section) - fields)
    if unknown:
        raise AsrflowError(
            f"params.yaml: unknown key(s) {', '.join(f'{name}.{key}' for key in unknown)}; "
            f"valid keys are: {', '.join(sorted(fields))}"
        )
    for key, value in section.items():
        check_type(value, hints[key], f"{name}.{key}")
    return cls(**section)


def check_type(value: Any, annotation: Any, where: str) -> None:
    """Raise an :class:`AsrflowError` naming ``where`` (``section.key``) unless ``value`` fits ``annotation``."""
    if not _type_ok(value, annotation):
        raise AsrflowError(f"params.yaml: {where} = {value!r} has the wrong type; expected {annotation}")


#: A section's name, or a mapping from each key to its section (a config read from several sections).
Section = str | Mapping[str, str]


def param_error(section: Section, key: str, value: Any, why: str) -> AsrflowError:
    """The one-line message for ``section.key = value`` being out of range: ``why`` says what is allowed."""
    where = section if isinstance(section, str) else section.get(key, "train")
    return AsrflowError(f"params.yaml: {where}.{key} = {value!r} {why}")


def check_at_least(config: object, section: Section, minimum: float, *keys: str) -> None:
    """Raise :func:`param_error` unless ``config.key >= minimum`` for every key."""
    for key in keys:
        value = getattr(config, key)
        if value < minimum:
            raise param_error(section, key, value, f"must be at least {minimum}")


def check_positive(config: object, section: Section, *keys: str) -> None:
    """Raise :func:`param_error` unless ``config.key > 0`` for every key."""
    for key in keys:
        value = getattr(config, key)
        if not value > 0:
            raise param_error(section, key, value, "must be greater than 0")


def check_choice(config: object, section: Section, key: str, choices: Iterable[str]) -> None:
    """Raise :func:`param_error` unless ``config.key`` is one of ``choices``."""
    choices = tuple(choices)
    value = getattr(config, key)
    if value not in choices:
        raise param_error(section, key, value, f"is not valid; use one of {', '.join(choices)}")


def env_number(name: str, default: float) -> float:
    """The number >= 0 in environment variable ``name``, ``default`` when it is not set.

    Raises:
        AsrflowError: the variable is set but is not a number >= 0.
    """
    raw = os.environ.get(name, str(default))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise AsrflowError(f"{name}={raw!r}: give a number >= 0 (the default is {default:g})")
    return value


def read_seed(params: dict[str, Any]) -> int:
    """The shared top-level ``seed`` of ``params.yaml`` (0 when left out), checked to be an integer."""
    seed = params.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise AsrflowError(f"params.yaml: seed = {seed!r} must be an integer (e.g. seed: 42)")
    return seed


def committed_params(path: str | os.PathLike = "params.yaml") -> dict | None:
    """``path`` as committed in git's HEAD (what a training run's params are compared with), or None."""
    command = ["git", "show", f"HEAD:./{Path(path).name}"]
    try:
        shown = subprocess.run(command, capture_output=True, text=True, timeout=10, cwd=Path(path).resolve().parent)
        loaded = yaml.safe_load(shown.stdout) if shown.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, yaml.YAMLError):
        return None
    return loaded if isinstance(loaded, dict) else None


def flatten(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested sections into dotted keys: ``{'train': {'lr': 1}} -> {'train.lr': 1}``."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def set_param(params: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``params[a][b][c] = value`` for ``dotted`` = ``"a.b.c"``, making missing sections."""
    *sections, key = dotted.split(".")
    node = params
    for section in sections:
        node = node.setdefault(section, {})
    node[key] = value
