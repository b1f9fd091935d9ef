"""User-facing errors: one clear message, no traceback."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., object])

#: Exit code for a mistake the user can fix (bad param, missing file, too much bad data).
EXIT_USER_ERROR = 2


class AsrflowError(Exception):
    """A problem the user can fix. The message names the item and says what to do."""


def exit_on_user_error(main: F) -> F:
    """Decorate a stage's ``main`` so that :class:`AsrflowError` prints one line and exits 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except AsrflowError as error:
            logging.getLogger("asrflow").error("%s", error)
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(EXIT_USER_ERROR) from None

    return wrapper  # type: ignore[return-value]
