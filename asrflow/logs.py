"""Logging set-up and progress reporting for long loops."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

LOG_FORMAT = "%(asctime)s %(levelname)s [%(name)s] %(message)s"

logger = logging.getLogger(__name__)



def setup_logging(level: int = logging.INFO) -> None:
    """Log to stderr in one format for every stage.

    Every module logs under its import path (``logging.getLogger(__name__)``; a stage
    script, run as ``__main__``, spells it: ``"stages.train"``), shown as ``[name]``. Under
    torchrun with several processes every line also names its rank (``[rank 1]``): all ranks
    write to the same terminal.
    """
    log_format = LOG_FORMAT
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        log_format = LOG_FORMAT.replace("[%(name)s]", f"[rank {os.environ.get('RANK', '?')}] [%(name)s]")
    logging.basicConfig(level=level, format=log_format, stream=sys.stderr, force=True)


def progress(
    items: Iterable[T], desc: str, total: int | None = None, log_every_s: float = 30.0
) -> Iterator[T]:
    """Iterate with a tqdm bar on a terminal, or a log line every ``log_every_s`` otherwise."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        yield from tqdm(items, desc=desc, total=total)
        return
    last = time.monotonic()
    count = 0
    for count, item in enumerate(items, start=1):
        yield item
        now = time.monotonic()
        if now - last >= log_every_s:
            last = now
            of_total = f"/{total}" if total else ""
            logger.info("%s: %d%s", desc, count, of_total)
