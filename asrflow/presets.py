"""Presets: files of params.yaml overrides (``presets/*.yaml``) that hold only the keys they change.

Applying one writes its values into params.yaml itself, keeping the file's comments and order, so that
Snakemake and DVC, which read params.yaml, both see the result and re-run what it changes::

    python -m asrflow.presets presets/real-corpus.yaml [--params params.yaml]

A key the preset names that params.yaml does not have is refused (with the nearest valid key); the values
are checked by each stage, as params.yaml's own are.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path
from typing import Any

from asrflow.errors import AsrflowError, exit_on_user_error
from asrflow.params import load_params, with_overrides


def load_preset(path: str | Path) -> dict[str, Any]:
    """The overrides in ``path`` (a mapping of params.yaml sections), read with ``yaml.safe_load``."""
    preset = load_params(path)
    if not preset:
        raise AsrflowError(f"preset {path} sets no key")
    return preset


def preset_params(params: dict[str, Any], preset_path: str | Path) -> dict[str, Any]:
    """``params`` with the preset in ``preset_path`` applied (nothing written)."""
    return with_overrides(params, load_preset(preset_path), f"preset {preset_path}")


def apply_preset(preset_path: str | Path, params_path: str | Path = "params.yaml") -> list[str]:
    """Write the preset's values into ``params_path`` in place (comments kept); the dotted keys it changed.
    A preset with an unknown key leaves the file as it was."""
    from ruamel.yaml import YAML

    from asrflow.params import flatten

    base = load_params(params_path)
    merged = preset_params(base, preset_path)
    changed = sorted(key for key, value in flatten(merged).items() if flatten(base).get(key, object()) != value)
    yaml = YAML()  # round-trip: comments, order and flow style survive, the preset's own included
    yaml.preserve_quotes = True
    yaml.width = 4096  # a long flow mapping stays on its line
    yaml.representer.add_representer(type(None), _null)
    document = yaml.load(Path(params_path).read_text())
    _write_into(document, yaml.load(Path(preset_path).read_text()))
    out = io.StringIO()
    yaml.dump(document, out)
    Path(params_path).write_text(out.getvalue())
    return changed


def _null(representer, _value):
    return representer.represent_scalar("tag:yaml.org,2002:null", "null")


def _write_into(node, overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(node.get(key), dict) and node[key]:
            _write_into(node[key], value)
        else:
            node[key] = value


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset", help="a preset file, e.g. presets/real-corpus.yaml")
    parser.add_argument("--params", default="params.yaml", help="params file to change (default: %(default)s)")
    args = parser.parse_args(argv)
    changed = apply_preset(args.preset, args.params)
    print(f"{args.params}: {len(changed)} key(s) set from {args.preset}: {', '.join(changed) or 'none changed'}")


if __name__ == "__main__":
    main(sys.argv[1:])
