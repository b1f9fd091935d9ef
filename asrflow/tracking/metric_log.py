"""The exactly-once metric protocol, with no store: one point per metric and step, across crashes. Points travel
in the checkpoint until a writer confirms them; the store's watermark decides what a resume writes again."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from asrflow.errors import AsrflowError

#: One point: (metric, step, value, Unix time in ms).
Point = tuple[str, int, float, int]
STATE_VERSION = 1


def now_ms() -> int:
    return int(time.time() * 1000)


class MetricLog:
    """Recorded points not yet confirmed by the store, in step order."""

    def __init__(self) -> None:
        self.pending: list[Point] = []
        self.recorded_through = -1  # highest step recorded (or restored)
        self.logged_through = -1  # the store's watermark
        self._written_through = -1  # highest step of a confirmed point
        self._sent: set[Point] = set()  # handed to a writer, not yet confirmed
        self._skip: set[tuple[str, int]] = set()  # already in the store past the checkpoint

    def record(self, step: int, metrics: Mapping[str, Any], *, timestamp_ms: int | None = None) -> None:
        """Keep one point per metric at ``step`` (the global step, never decreasing); None values are skipped."""
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        timestamp = now_ms() if timestamp_ms is None else int(timestamp_ms)
        for key, value in metrics.items():
            if value is not None and (key, step) not in self._skip:
                self.pending.append((str(key), step, float(value), timestamp))
        self.recorded_through = max(self.recorded_through, step)

    def discard_after(self, step: int) -> int:
        """Drop the points of steps after ``step`` (a rollback to its checkpoint); returns how many."""
        kept, dropped = [p for p in self.pending if p[1] <= step], sum(p[1] > step for p in self.pending)
        self.pending, self._sent = kept, self._sent & set(kept)
        self.recorded_through = min(self.recorded_through, int(step))
        return dropped

    def unsent(self, limit: int, through: int | None = None) -> list[Point]:
        """The first ``limit`` points not handed to a writer yet (of steps up to ``through``)."""
        last = self.recorded_through if through is None else through
        return [point for point in self.pending if point not in self._sent and point[1] <= last][:limit]

    def mark_sent(self, points: Iterable[Point]) -> None:
        self._sent.update(points)

    def confirm(self, points: Iterable[Point]) -> None:
        """The store committed ``points``: they leave the log."""
        done = set(points)
        self.pending, self._sent = [point for point in self.pending if point not in done], self._sent - done
        self._written_through = max([self._written_through, *(point[1] for point in done)])

    def unsend(self, points: Iterable[Point]) -> None:
        """A write failed: ``points`` are sent again by the next flush."""
        self._sent -= set(points)

    def stored_through(self) -> int:
        """The highest step at or below which every point is confirmed: the watermark to claim."""
        through = max(self._written_through, self.logged_through)
        return min(through, min(point[1] for point in self.pending) - 1) if self.pending else through

    def state_dict(self) -> dict[str, Any]:
        """Plain python types for a checkpoint: the unconfirmed points and the last step recorded."""
        pending = [list(point) for point in self.pending]
        return {"version": STATE_VERSION, "recorded_through": self.recorded_through, "pending": pending}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Add a checkpoint's points to the log (a resume, or a rollback after :meth:`discard_after`)."""
        if state.get("version") != STATE_VERSION:
            raise AsrflowError(
                f"tracking state in the checkpoint has version {state.get('version')!r}, "
                f"expected {STATE_VERSION}: delete the checkpoints to start a new run"
            )
        restored = [(str(key), int(step), float(value), int(ts)) for key, step, value, ts in state["pending"]]
        seen = {(point[0], point[1]) for point in restored}
        merged = restored + [point for point in self.pending if (point[0], point[1]) not in seen]
        self.pending = sorted(merged, key=lambda point: point[1])
        self.recorded_through = max(self.recorded_through, int(state.get("recorded_through", -1)))

    def check_window(self) -> tuple[int, int] | None:
        """Steps ``(low, high]`` a flush that died before its watermark, or a later checkpoint's, may have stored."""
        through, recorded = self.logged_through, self.recorded_through
        if through > recorded or any(point[1] > through for point in self.pending):
            return min(through, recorded), max(through, recorded)
        return None

    def reconcile(self, stored: set[tuple[str, int]]) -> None:
        """Drop points at or below the watermark and the ``stored`` pairs (from :meth:`check_window`); those past
        :attr:`recorded_through` are skipped when recorded again."""
        self.pending = [p for p in self.pending if p[1] > self.logged_through and (p[0], p[1]) not in stored]
        self._sent &= set(self.pending)
        self._skip = {pair for pair in stored if pair[1] > self.recorded_through}
        self._written_through = max(self._written_through, self.logged_through)
