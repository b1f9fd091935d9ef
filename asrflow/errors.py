"""User-facing errors: one clear message, no traceback."""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., object])

logger = logging.getLogger(__name__)

#: Exit code for a mistake the user can fix (bad param, missing file, too much bad data).
EXIT_USER_ERROR = 2


class AsrflowError(Exception):
    """A problem the user can fix. The message names the item and says what to do."""


def require_extra(module: str, extra: str, purpose: str):
    """Import ``module``, a package of asrflow's optional ``extra`` that ``purpose`` needs; an
    :class:`AsrflowError` that says how to install it when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise AsrflowError(
            f"{purpose} needs {module.split('.')[0]!r}, which is not installed: pip install 'asrflow[{extra}]'"
        ) from None


def first_line(error: BaseException) -> str:
    """A one-line summary of an exception's message.

    Lhotse's audio errors list one line per backend (``Exception #0 (<backend>): <type>:
    message``); the first backend's message is the telling one, so it is used when present.
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if line.startswith("Exception #0"):
            return line.rsplit("'>: ", 1)[-1]
    return lines[0] if lines else type(error).__name__


def exit_on_user_error(main: F) -> F:
    """Decorate a stage's ``main`` so that :class:`AsrflowError` prints one line and exits 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except AsrflowError as error:
            logger.error("%s", error)
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(EXIT_USER_ERROR) from None

    return wrapper  # type: ignore[return-value]
