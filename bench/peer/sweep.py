"""Each side's fastest thread and worker setting, from a few steps at each candidate.

Every candidate runs once per round and counts by its best round: a load spike on a shared machine
lands on one candidate's run, and would otherwise decide the pick.
"""

from __future__ import annotations

from collections.abc import Callable

#: asrflow (num_threads, num_workers); SpeechBrain num_threads (its recipes read precomputed features).
ASRFLOW_CANDIDATES = [(1, 2), (1, 0), (2, 0), (2, 1)]
PEER_CANDIDATES = [1, 2]
SWEEP_STEPS = 20
SWEEP_ROUNDS = 2


def median_step_rate(steps: list[dict]) -> float | None:
    """Median over the second half of the steps of one step's audio seconds / its wall seconds: robust to
    a load spike, and past asrflow's first steps, during which MLflow opens its run in the background."""
    half = steps[len(steps) // 2 - 1 :] if len(steps) > 2 else steps
    rates = sorted(b["audio_s"] / (b["t"] - a["t"]) for a, b in zip(half, half[1:], strict=False) if b["t"] > a["t"])
    return rates[len(rates) // 2] if rates else None


def sweep(rate_of: Callable[[str, int, int, str], float | None], peer: bool) -> tuple[dict, dict]:
    """``rate_of(side, threads, workers, run name)`` for every candidate in every round => :func:`pick_settings`."""
    candidates = [("asrflow", threads, workers) for threads, workers in ASRFLOW_CANDIDATES]
    candidates += [("speechbrain", threads, 0) for threads in PEER_CANDIDATES] if peer else []
    rates: dict[tuple, list] = {candidate: [] for candidate in candidates}
    for round_index in range(SWEEP_ROUNDS):
        for side, threads, workers in candidates:
            name = f"sweep-{side}-{threads}-{workers}-round{round_index}"  # each round keeps its own log
            rates[side, threads, workers].append(rate_of(side, threads, workers, name))
    return pick_settings(rates)


def pick_settings(rates: dict[tuple[str, int, int], list[float | None]]) -> tuple[dict, dict]:
    """``(side, threads, workers)`` -> the rate of each round (None: no figure) => each side's fastest
    setting by its best round, and the sweep's figures per side."""
    figures: dict[str, list] = {"asrflow": [], "speechbrain": []}
    for (side, threads, workers), found in rates.items():
        row = {"num_threads": threads, "num_workers": workers, "audio_s_per_s": max(r or 0 for r in found)}
        figures[side].append({**row, "audio_s_per_s_of_each_round": found})
    best = {side: max(rows, key=lambda r: r["audio_s_per_s"]) for side, rows in figures.items() if rows}
    return best, figures
