"""Reading ``params.yaml`` safely and turning a section into a typed, validated config."""

from __future__ import annotations

import dataclasses
import typing
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
        return isinstance(value, (list, tuple))
    if origin is dict:
        return isinstance(value, dict)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True


def build_config(cls: type[C], section: dict[str, Any] | None, name: str) -> C:
    """Build dataclass ``cls`` from ``params.yaml`` section ``name``.

    Unknown keys and values of the wrong type end in an :class:`AsrflowError` that names
    the key; keys left out take the dataclass defaults.
    """
    section = dict(section or {})
    hints = typing.get_type_hints(cls)
    fields = {field.name for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(section) - fields)
    if unknown:
        raise AsrflowError(
            f"params.yaml: unknown key(s) {', '.join(f'{name}.{key}' for key in unknown)}; "
            f"valid keys are: {', '.join(sorted(fields))}"
        )
    for key, value in section.items():
        if not _type_ok(value, hints[key]):
            raise AsrflowError(
                f"params.yaml: {name}.{key} = {value!r} has the wrong type; expected {hints[key]}"
            )
    return cls(**section)


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
