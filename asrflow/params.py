"""Reading ``params.yaml`` safely and turning a section into a typed, validated config."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import subprocess
import typing
from collections.abc import Iterable
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


def build_config(
    cls: type[C], section: dict[str, Any] | None, name: str, *, neighbours: dict[str, type] | None = None
) -> C:
    """Build dataclass ``cls`` from ``params.yaml`` section ``name`` (``train.optim``, say).

    A field whose type is itself a dataclass is built from the sub-section of the same name. An unknown key
    names its path and the nearest valid key, or the section it belongs in when ``cls`` or one of the
    ``neighbours`` (other sections by name, e.g. ``{"run": RunConfig}``) has it; a key the dataclass has no
    default for must be given; a value of the wrong type names its path. Each failure is one
    :class:`AsrflowError`.
    """
    homes = _key_homes(cls, name)
    for other, other_cls in (neighbours or {}).items():
        for key, places in _key_homes(other_cls, other).items():
            homes.setdefault(key, []).extend(places)
    return _build(cls, section, name, homes=homes)


def _build(cls: type[C], section: Any, name: str, *, homes: dict[str, list[str]]) -> C:
    section = dict(require_mapping(section, name))
    hints = typing.get_type_hints(cls)
    fields = {field.name: field for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(section) - set(fields))
    if unknown:
        hint = _nearest(unknown[0], name, sorted(fields), homes)
        raise AsrflowError(f"params.yaml: unknown key {name}.{unknown[0]}; {hint}")
    missing = [
        key
        for key, field in fields.items()
        if key not in section
        and field.default is dataclasses.MISSING
        and field.default_factory is dataclasses.MISSING
        and not _is_section(hints[key])
    ]
    if missing:
        raise AsrflowError(
            f"params.yaml: {', '.join(f'{name}.{key}' for key in missing)} missing; add it (the shipped params.yaml "
            "documents each key and its default)"
        )
    values = {}
    for key in fields:
        if _is_section(hints[key]) and not isinstance(section.get(key), hints[key]):
            values[key] = _build(hints[key], section.get(key), f"{name}.{key}", homes=homes)
        elif key in section:
            check_type(section[key], hints[key], f"{name}.{key}")
            values[key] = section[key]
    return cls(**values)


def _is_section(annotation: Any) -> bool:
    return dataclasses.is_dataclass(annotation) and isinstance(annotation, type)


def _key_homes(cls: type, name: str) -> dict[str, list[str]]:
    """Every key of ``cls`` and its sub-sections, with the sections (dotted) that hold it."""
    homes: dict[str, list[str]] = {}
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if _is_section(hints[field.name]):
            for key, places in _key_homes(hints[field.name], f"{name}.{field.name}").items():
                homes.setdefault(key, []).extend(places)
        else:
            homes.setdefault(field.name, []).append(name)
    return homes


def _nearest(key: str, name: str, valid: list[str], homes: dict[str, list[str]]) -> str:
    """The hint for an unknown ``key`` in section ``name``: where it belongs, or the closest valid key."""
    elsewhere = [place for place in homes.get(key, []) if place != name]
    if elsewhere:
        return f"it belongs in {' or '.join(f'{place}.{key}' for place in elsewhere)}"
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    nearest = f"did you mean {name}.{close[0]}? " if close else ""
    return f"{nearest}valid keys are: {', '.join(valid)}"


def check_type(value: Any, annotation: Any, where: str) -> None:
    """Raise an :class:`AsrflowError` naming ``where`` (``section.key``) unless ``value`` fits ``annotation``."""
    if not _type_ok(value, annotation):
        raise AsrflowError(f"params.yaml: {where} = {value!r} has the wrong type; expected {annotation}")


def param_error(section: str, key: str, value: Any, why: str) -> AsrflowError:
    """The one-line message for ``section.key = value`` being out of range: ``why`` says what is allowed."""
    return AsrflowError(f"params.yaml: {section}.{key} = {value!r} {why}")


def check_at_least(config: object, section: str, minimum: float, *keys: str) -> None:
    """Raise :func:`param_error` unless ``config.key >= minimum`` for every key."""
    for key in keys:
        value = getattr(config, key)
        if value < minimum:
            raise param_error(section, key, value, f"must be at least {minimum}")


def check_positive(config: object, section: str, *keys: str) -> None:
    """Raise :func:`param_error` unless ``config.key > 0`` for every key."""
    for key in keys:
        value = getattr(config, key)
        if not value > 0:
            raise param_error(section, key, value, "must be greater than 0")


def check_choice(config: object, section: str, key: str, choices: Iterable[str]) -> None:
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


def nested(dotted: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys as nested sections: ``{'train.optim.lr': 1}`` -> ``{'train': {'optim': {'lr': 1}}}``."""
    tree: dict[str, Any] = {}
    for key, value in dotted.items():
        set_param(tree, key, value)
    return tree


def with_overrides(base: dict[str, Any], overrides: dict[str, Any], source: str) -> dict[str, Any]:
    """A copy of ``base`` (a loaded params.yaml) with ``overrides`` (nested sections, or dotted keys) set.

    Only keys ``base`` has can be set (a mapping value that ``base`` leaves empty, like ``recipe_args: {}``,
    takes any keys); anything else is refused with one :class:`AsrflowError` naming ``source``, the key's path
    and the nearest valid key.
    """
    if any("." in key for key in overrides):
        overrides = nested(overrides)
    merged = copy.deepcopy(base)
    _merge(merged, copy.deepcopy(overrides), "", source)
    return merged


def _merge(node: dict[str, Any], overrides: dict[str, Any], path: str, source: str) -> None:
    for key, value in overrides.items():
        if key not in node:
            close = difflib.get_close_matches(str(key), [str(k) for k in node], n=1, cutoff=0.6)
            hint = f"; did you mean {path}{close[0]}?" if close else f"; {path or 'the top level'} holds {sorted(node)}"
            raise AsrflowError(f"{source}: unknown key {path}{key} (params.yaml has no such key){hint}")
        if isinstance(value, dict) and isinstance(node[key], dict) and node[key]:
            _merge(node[key], value, f"{path}{key}.", source)
        else:
            node[key] = value
