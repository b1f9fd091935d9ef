"""The evaluation report files: written whole, parseable, consistent with the score."""

from __future__ import annotations

import csv
import json

import pytest

from asrflow.evaluation.metrics import score_corpus
from asrflow.evaluation.report import (
    ERRORS_FILE,
    METRICS_FILE,
    METRICS_TABLE_FILE,
    PER_UTTERANCE_FILE,
    TEST_SET_KEYS,
    WER_BY_DURATION_FILE,
    bucket_width,
    wer_by_duration,
    wer_by_duration_figure,
    write_report,
)

REFS = {"a": "A B C D", "b": "YES NO", "c": "YES", "d": "NO NO NO NO"}
HYPS = {"a": "A X C", "b": "YES NO", "c": "YES YES", "d": "NO NO NO NO"}
DURATIONS = {"a": 1.5, "b": 3.0, "c": 0.4, "d": 5.9}


def read_csv(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_report_files_are_written_and_parse(tmp_path):
    score = score_corpus(REFS, HYPS)
    out = tmp_path / "eval"
    metrics = write_report(out, {"test": score}, DURATIONS, rtf={"decode": 0.05, "rtf_total": 0.2})

    assert sorted(p.name for p in out.iterdir()) == sorted(
        [METRICS_FILE, PER_UTTERANCE_FILE, ERRORS_FILE, WER_BY_DURATION_FILE]
    )
    on_disk = json.loads((out / METRICS_FILE).read_text())
    assert on_disk == metrics
    flat = {key: value for key, value in on_disk.items() if key != "test_sets"}
    assert all(isinstance(value, int | float) for value in flat.values())
    # One test set: its row holds the same numbers as the top level.
    same = {key: on_disk[key] for key in TEST_SET_KEYS if key != "char_errors"}
    assert on_disk["test_sets"] == {"test": same | {"char_errors": score.chars.errors}}
    # 11 reference words; errors: a (1 sub, 1 del), c (1 ins).
    assert on_disk["wer"] == pytest.approx(3 / 11)
    assert (on_disk["substitutions"], on_disk["deletions"], on_disk["insertions"]) == (1, 1, 1)
    assert on_disk["sub_rate"] == pytest.approx(1 / 11)
    assert on_disk["ref_words"] == 11
    assert on_disk["num_utterances"] == 4
    assert on_disk["duration_s"] == pytest.approx(10.8)
    assert on_disk["rtf_decode"] == 0.05 and on_disk["rtf_total"] == 0.2
    assert on_disk["cer"] == pytest.approx(score.cer)

    rows = [json.loads(line) for line in (out / PER_UTTERANCE_FILE).read_text().splitlines()]
    assert [row["id"] for row in rows] == ["a", "b", "c", "d"]
    assert {row["test_set"] for row in rows} == {"test"}
    first = rows[0]
    assert (first["ref"], first["hyp"], first["duration"], first["errors"]) == ("A B C D", "A X C", 1.5, 2)
    assert first["alignment"] == [["A", "A"], ["B", "X"], ["C", "C"], ["D", "*"]]

    text = (out / ERRORS_FILE).read_text()
    assert "WER 27.27%" in text
    for error in ("sub: B -> X", "del: D", "ins: YES"):
        assert error in text

    # Longest is 5.9 s -> 1 s buckets; empty buckets are left out.
    table = read_csv(out / WER_BY_DURATION_FILE)
    assert list(table[0]) == ["duration_bucket", "wer", "num_utterances"]
    assert [(r["duration_bucket"], float(r["wer"]), int(r["num_utterances"])) for r in table] == [
        ("0-1s", 1.0, 1),
        ("1-2s", 0.5, 1),
        ("3-4s", 0.0, 1),
        ("5-6s", 0.0, 1),
    ]


def test_several_test_sets_get_a_row_each_and_a_pooled_overall(tmp_path):
    """clean: 2 errors / 6 words; other: 1 error / 5 words. Overall 3 / 11, not the mean of 1/3 and 1/5."""
    sets = {"clean": ["a", "b"], "other": ["c", "d"]}
    scores = {name: score_corpus({i: REFS[i] for i in ids}, HYPS) for name, ids in sets.items()}
    loss_csv = tmp_path / "train_loss.csv"
    loss_csv.write_text("step,loss\n1,5.0\n")
    metrics = write_report(tmp_path / "eval", scores, DURATIONS, loss_csv=loss_csv)

    on_disk = json.loads((tmp_path / "eval" / METRICS_FILE).read_text())
    assert on_disk == metrics and list(on_disk["test_sets"]) == ["clean", "other"]
    clean, other = on_disk["test_sets"]["clean"], on_disk["test_sets"]["other"]
    assert (clean["word_errors"], clean["ref_words"], clean["num_utterances"]) == (2, 6, 2)
    assert (other["word_errors"], other["ref_words"], other["num_utterances"]) == (1, 5, 2)
    assert clean["wer"] == pytest.approx(2 / 6) and other["wer"] == pytest.approx(1 / 5)
    assert clean["duration_s"] == pytest.approx(4.5) and other["duration_s"] == pytest.approx(6.3)
    assert on_disk["wer"] == pytest.approx(3 / 11) != pytest.approx((2 / 6 + 1 / 5) / 2)
    assert (on_disk["word_errors"], on_disk["ref_words"], on_disk["num_utterances"]) == (3, 11, 4)
    pooled_chars = clean["char_errors"] + other["char_errors"]
    assert on_disk["cer"] == pytest.approx(pooled_chars / (clean["ref_chars"] + other["ref_chars"]))

    rows = [json.loads(line) for line in (tmp_path / "eval" / PER_UTTERANCE_FILE).read_text().splitlines()]
    assert [(row["test_set"], row["id"]) for row in rows] == [
        ("clean", "a"),
        ("clean", "b"),
        ("other", "c"),
        ("other", "d"),
    ]
    text = (tmp_path / "eval" / ERRORS_FILE).read_text()
    assert text.startswith("WER 27.27% (3 errors / 11 words") and "of 2 test sets" in text
    assert "clean:\n  WER 33.33% (2 errors / 6 words" in text and "other:\n  WER 20.00% (1 errors / 5 words" in text
    table = (tmp_path / "eval" / METRICS_TABLE_FILE).read_text()
    names = [
        line.split("</th>")[0].removeprefix("<tr><th>") for line in table.splitlines() if line.startswith("<tr><th>")
    ]
    assert names == ["test set", "clean", "other", "overall"]
    assert "<tr><th>overall</th><td>27.27 %</td>" in table and "<td>3 errors / 11 words</td>" in table


def test_bucket_width_follows_the_data():
    assert bucket_width([0.3, 2.0]) == 0.5
    assert bucket_width([1.0, 6.2]) == 1.0
    assert bucket_width([0.5, 19.9]) == 2.0
    assert bucket_width([35.0]) == 5.0
    assert bucket_width([]) == 0.5


def test_wer_by_duration_pools_errors_and_skips_unknown_durations():
    score = score_corpus({"a": "A B", "b": "A B C D", "c": "A"}, {"a": "A", "b": "A B C D", "c": "B"})
    rows = wer_by_duration(score, {"a": 0.2, "b": 0.4})
    # a and b share 0-0.5s: 1 error / 6 words; c has no duration.
    assert rows == [{"duration_bucket": "0-0.5s", "wer": round(1 / 6, 6), "num_utterances": 2}]


def test_wer_by_duration_figure_draws_one_bar_per_bucket_shortest_on_top():
    rows = wer_by_duration(score_corpus(REFS, HYPS), DURATIONS)
    assert len(rows) > 2
    figure = wer_by_duration_figure(rows)
    (axes,) = figure.axes
    bars = axes.patches
    assert [bar.get_width() for bar in bars] == pytest.approx([row["wer"] for row in rows])
    labels = [label.get_text() for label in axes.get_yticklabels()]
    assert labels == [row["duration_bucket"] for row in rows]
    # Bars in row order on an inverted y axis: the first (shortest) bucket is drawn on top.
    assert axes.yaxis_inverted()
    positions = [bar.get_y() for bar in bars]
    assert positions == sorted(positions)
    assert "WER" in axes.get_xlabel()


def test_missing_durations_and_rewrites(tmp_path):
    score = score_corpus(REFS, HYPS)
    write_report(tmp_path, {"test": score}, {"a": 1.0})
    rows = [json.loads(line) for line in (tmp_path / PER_UTTERANCE_FILE).read_text().splitlines()]
    assert [row["duration"] for row in rows] == [1.0, None, None, None]
    assert [r["num_utterances"] for r in read_csv(tmp_path / WER_BY_DURATION_FILE)] == ["1"]
    assert "rtf_decode" not in json.loads((tmp_path / METRICS_FILE).read_text())

    better = score_corpus(REFS, REFS)
    metrics = write_report(tmp_path, {"test": better}, DURATIONS)
    assert metrics["wer"] == 0.0
    assert json.loads((tmp_path / METRICS_FILE).read_text())["wer"] == 0.0
    assert "none" in (tmp_path / ERRORS_FILE).read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_figures_and_metrics_table_for_people(tmp_path):
    from asrflow.evaluation.report import TRAIN_LOSS_FIGURE_FILE, WER_BY_DURATION_FIGURE_FILE

    loss_csv = tmp_path / "train_loss.csv"
    loss_csv.write_text("step,loss\n1,5.0\n2,3.5\n3,2.25\n")
    out = tmp_path / "eval"
    metrics = write_report(out, {"test": score_corpus(REFS, HYPS)}, DURATIONS, loss_csv=loss_csv)
    table = (out / METRICS_TABLE_FILE).read_text()
    assert f"<th>test</th><td>27.27 %</td><td>{100 * metrics['cer']:.2f} %</td>" in table
    assert "<td>3 errors / 11 words</td>" in table and "overall" not in table  # one set: no pooled row
    loss_svg = (out / TRAIN_LOSS_FIGURE_FILE).read_text()
    wer_svg = (out / WER_BY_DURATION_FIGURE_FILE).read_text()
    assert loss_svg.startswith("<?xml") and "Training loss per step" in loss_svg
    assert "Test WER by utterance duration" in wer_svg
    # The same numbers give the same bytes (no date, fixed ids): DVC and Snakemake agree.
    again = tmp_path / "again"
    write_report(again, {"test": score_corpus(REFS, HYPS)}, DURATIONS, loss_csv=loss_csv)
    for name in (METRICS_TABLE_FILE, TRAIN_LOSS_FIGURE_FILE, WER_BY_DURATION_FIGURE_FILE):
        assert (again / name).read_bytes() == (out / name).read_bytes()
    other = tmp_path / "other"
    loss_csv.write_text("step,loss\n1,5.0\n2,1.0\n")
    write_report(other, {"test": score_corpus(REFS, HYPS)}, DURATIONS, loss_csv=loss_csv)
    assert (other / TRAIN_LOSS_FIGURE_FILE).read_bytes() != (out / TRAIN_LOSS_FIGURE_FILE).read_bytes()
