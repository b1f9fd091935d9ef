"""bench.memory_hour's verdict on a run's memory: windows, levelling, readings against steps."""

from __future__ import annotations

import pytest

from bench.memory_hour import levelled, main, rss_by_step, windows


def rows(per_minute: list[float]) -> list[list]:
    """:func:`bench.stage_scale.by_minute` rows: 10 steps a minute, the given highest RSS (MB), PSS 0."""
    return [[minute, 10 * minute + 10, mb, 0.0] for minute, mb in enumerate(per_minute)]


def test_windows_group_ten_minutes():
    found = windows(rows([100.0] * 5 + [200.0] * 10 + [300.0] * 3))
    assert [w["minutes"] for w in found] == [[0, 9], [10, 19]]
    assert found[0]["steps"] == [10, 100] and found[0]["rss_median_mb"] == 150.0
    assert found[1]["rss_highest_mb"] == 300.0 and found[1]["rss_median_mb"] == 200.0


def test_a_run_that_rises_then_stays_level_is_levelled():
    warm_up = [1000.0 + 50 * minute for minute in range(10)]
    level = [1500.0 + (20.0 if minute % 3 == 0 else -10.0) for minute in range(50)]
    verdict = levelled(rows(warm_up + level))
    assert verdict["levelled"] is True, verdict
    assert verdict["spread"] < 0.01 and abs(verdict["trend_mb_per_10_min"]) < 5


def test_a_slow_creep_is_not_levelled():
    creep = [1500.0 * (1 + 0.002 * minute) for minute in range(60)]  # +0.2 % a minute: +10 % over 50 minutes
    verdict = levelled(rows(creep))
    assert verdict["levelled"] is False, verdict
    assert verdict["trend_mb_per_10_min"] > 25


def test_too_short_a_run_gets_no_verdict():
    assert levelled(rows([1000.0] * 19))["levelled"] is None  # one window after minute 10


def test_readings_take_the_last_step_logged_before_them():
    samples = [(1.0, 2**20, 0), (5.0, 2 * 2**20, 0), (9.0, 3 * 2**20, 0)]
    assert rss_by_step(samples, [(2.0, 10), (4.0, 20), (8.5, 30)]) == [(0, 1.0), (20, 2.0), (30, 3.0)]


@pytest.mark.pipeline
def test_quick_run_trains_each_precision_side_by_side_and_draws_them(tmp_path):
    plot = tmp_path / "memory.png"
    records = main(["--quick", "--workdir", str(tmp_path / "w"), "--plot", str(plot)])
    runs = {record["precision"]: record for record in records if record["benchmark"] == "memory_hour"}
    assert sorted(runs) == ["bf16", "fp32"]
    for record in runs.values():
        assert record["exit_code"] == 75 and record["steps"] > 0, record  # stopped by SIGTERM after training
        assert record["memory_by_minute"] and record["peak_tree_rss_mb"] > 100, record
        assert record["levelled"] is None  # 0.4 minutes: no verdict
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
