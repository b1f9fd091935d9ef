"""The evaluation report: metrics for ``dvc metrics``, a plot table, per-utterance rows.

Files written into ``out_dir``, each atomically (a crash leaves the previous version or
none, never half a file), ``metrics.json`` last so that its presence means the report
is complete:

- ``per_utterance.jsonl``: one JSON object per utterance (test set, id, duration in
  seconds, ref, hyp, word errors, alignment as ``[ref, hyp]`` pairs with ``"*"`` for a gap),
  written as the utterances are scored (the evaluate stage's decoding order) and never held:
  the other files need only :class:`ReportTotals`, whose size does not grow with the utterances.
- ``errors.txt``: totals (over all test sets, then per set) and the most frequent word
  errors, for people.
- ``wer_by_duration.csv``: ``duration_bucket,wer,num_utterances`` for ``dvc plots``.
  Buckets have equal width, the smallest of :data:`BUCKET_WIDTHS_S` that covers the
  longest utterance in at most :data:`MAX_BUCKETS` buckets (yesno's ~6 s clips give
  ``5-6s``, ``6-7s``; 20 s LibriSpeech utterances give ``0-2s`` ... ``18-20s``). A
  bucket's WER pools its utterances' errors and reference words (of every test set);
  empty buckets are left out.
- ``metrics.json``: at the top, flat numbers over every test set pooled (``wer``, ``cer``
  and their counts, rates and ``rtf_*``): all errors over all reference words, not a mean
  of the sets' rates. Under ``test_sets``, the same for each test set by name
  (:data:`TEST_SET_KEYS`), which ``dvc metrics show`` lists as ``test_sets.<name>.wer``.

For people (and ``snakemake --report``), :func:`write_figures` adds ``metrics.html`` (the
WER/CER table, a row per test set and one for all of them), ``wer_by_duration.svg`` and
``train_loss.svg`` (the training loss per step).
"""

from __future__ import annotations

import csv
import html
import logging
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from asrflow.evaluation.metrics import CorpusScore, ErrorCounts, UtteranceScore, error_labels, top_errors
from asrflow.files import atomic_path, write_json, write_jsonl

METRICS_FILE = "metrics.json"
PER_UTTERANCE_FILE = "per_utterance.jsonl"
ERRORS_FILE = "errors.txt"
WER_BY_DURATION_FILE = "wer_by_duration.csv"
METRICS_TABLE_FILE = "metrics.html"
WER_BY_DURATION_FIGURE_FILE = "wer_by_duration.svg"
TRAIN_LOSS_FIGURE_FILE = "train_loss.svg"
#: The columns of ``wer_by_duration.csv`` (and keys of :func:`wer_by_duration`'s rows).
WER_BY_DURATION_COLUMNS = ("duration_bucket", "wer", "num_utterances")

#: Candidate bucket widths for ``wer_by_duration.csv``, in seconds.
BUCKET_WIDTHS_S = (0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: The most buckets the chosen width may need.
MAX_BUCKETS = 10
#: Word errors listed in ``errors.txt``.
TOP_ERRORS = 50
#: The numbers ``metrics.json`` holds for each test set, under ``test_sets.<name>``.
TEST_SET_KEYS = ("wer", "cer", "word_errors", "ref_words", "char_errors", "ref_chars", "num_utterances", "duration_s")
#: The key of ``metrics.json`` that holds :data:`TEST_SET_KEYS` per test set.
TEST_SETS_KEY = "test_sets"
#: The row of the metrics table for every test set pooled.
OVERALL = "overall"

logger = logging.getLogger(__name__)


def bucket_width(durations: list[float]) -> float:
    """Smallest width in :data:`BUCKET_WIDTHS_S` (seconds) giving at most :data:`MAX_BUCKETS` buckets."""
    longest = max(durations, default=0.0)
    for width in BUCKET_WIDTHS_S:
        if longest < width * MAX_BUCKETS:
            return width
    return float(math.ceil(longest / MAX_BUCKETS + 1))


def _bucket(duration: float, width: float) -> tuple[int, str]:
    index = int(duration // width)
    return index, f"{index * width:g}-{(index + 1) * width:g}s"


class DurationBuckets:
    """Word error counts by utterance duration, summed as utterances come, for :func:`wer_by_duration`.

    The bucket width depends on the longest utterance, known only at the end, so the counts are
    kept for every width of :data:`BUCKET_WIDTHS_S` (and per whole second for the fallback width):
    memory grows with the longest duration (in seconds), not with the number of utterances.
    """

    def __init__(self) -> None:
        self.longest_s = 0.0
        self._by_width: dict[float, dict[tuple[int, str], tuple[ErrorCounts, int]]] = {
            width: {} for width in (*BUCKET_WIDTHS_S, 1.0)
        }

    def add(self, words: ErrorCounts, duration_s: float) -> None:
        """Count one utterance's word errors under its duration (seconds)."""
        self.longest_s = max(self.longest_s, duration_s)
        for width, buckets in self._by_width.items():
            key = _bucket(duration_s, width)
            counts, num = buckets.get(key, (ErrorCounts(), 0))
            buckets[key] = (counts + words, num + 1)

    def rows(self) -> list[dict[str, object]]:
        """:func:`wer_by_duration`'s rows for the utterances added."""
        width = bucket_width([self.longest_s] if self._by_width[1.0] else [])
        if width in self._by_width:
            buckets = self._by_width[width]
        else:  # wider than any candidate: whole-second buckets regrouped (an integer width)
            buckets = {}
            for (second, _), (counts, num) in self._by_width[1.0].items():
                key = _bucket(float(second), width)
                pooled, total = buckets.get(key, (ErrorCounts(), 0))
                buckets[key] = (pooled + counts, total + num)
        return [
            {"duration_bucket": label, "wer": round(counts.rate, 6), "num_utterances": num}
            for (_, label), (counts, num) in sorted(buckets.items())
        ]


def wer_by_duration(score: CorpusScore, durations: dict[str, float]) -> list[dict[str, object]]:
    """Rows ``{"duration_bucket": "0-2s", "wer": fraction, "num_utterances": n}``, shortest first.

    Utterances without a duration are left out.
    """
    buckets = DurationBuckets()
    for row in score.utterances:
        if durations.get(row.id) is not None:
            buckets.add(row.words, float(durations[row.id]))
    return buckets.rows()


@dataclass(kw_only=True)
class Totals:
    """Running sums over the scored utterances of a test set (or several): O(1) memory.

    ``duration`` (seconds) is summed exactly, so the total does not depend on the order of the utterances.
    """

    words: ErrorCounts = field(default_factory=ErrorCounts)
    chars: ErrorCounts = field(default_factory=ErrorCounts)
    num_utterances: int = 0
    num_missing_hyps: int = 0
    duration: Fraction = field(default_factory=Fraction)

    def add(self, row: UtteranceScore, duration_s: float | None) -> None:
        """Add one utterance; an unknown duration (``None``) adds nothing to :attr:`duration_s`."""
        self.words += row.words
        self.chars += row.chars
        self.num_utterances += 1
        self.num_missing_hyps += not row.has_hyp
        if duration_s is not None:
            self.duration += Fraction(float(duration_s))

    def __add__(self, other: Totals) -> Totals:
        return Totals(
            words=self.words + other.words,
            chars=self.chars + other.chars,
            num_utterances=self.num_utterances + other.num_utterances,
            num_missing_hyps=self.num_missing_hyps + other.num_missing_hyps,
            duration=self.duration + other.duration,
        )

    @property
    def duration_s(self) -> float:
        """The audio of the utterances with a known duration, in seconds."""
        return float(self.duration)


class ReportTotals:
    """What the report needs of every utterance, gathered as they are scored (in any order).

    Held: a :class:`Totals` per test set, :class:`DurationBuckets` and a count per distinct word
    error (for ``errors.txt``'s top list), none of which grows with the number of utterances
    (the error counts grow with the distinct errors only). :meth:`add` returns the utterance's row
    of ``per_utterance.jsonl`` for the caller to write at once.
    """

    def __init__(self, test_sets: Iterable[str]) -> None:
        self.by_set: dict[str, Totals] = {name: Totals() for name in test_sets}
        self.buckets = DurationBuckets()
        self.errors: Counter[str] = Counter()
        self.first_without_duration: str | None = None
        self.num_without_duration = 0

    def add(self, test_set: str, row: UtteranceScore, duration_s: float | None) -> dict:
        """Count ``row`` (of ``test_set``, ``duration_s`` seconds long or ``None``); its per-utterance row."""
        self.by_set[test_set].add(row, duration_s)
        self.errors.update(error_labels(row.alignment))
        if duration_s is None:
            self.num_without_duration += 1
            self.first_without_duration = self.first_without_duration or row.id
        else:
            self.buckets.add(row.words, float(duration_s))
        return {
            "test_set": test_set,
            "id": row.id,
            "duration": duration_s,
            "ref": row.ref,
            "hyp": row.hyp,
            "errors": row.words.errors,
            "substitutions": row.words.substitutions,
            "deletions": row.words.deletions,
            "insertions": row.words.insertions,
            "ref_words": row.words.ref_len,
            "char_errors": row.chars.errors,
            "has_hyp": row.has_hyp,
            "alignment": [list(pair) for pair in row.alignment],
        }

    @property
    def pooled(self) -> Totals:
        """Every test set's totals summed."""
        return sum(self.by_set.values(), Totals())


def wer_by_duration_figure(rows: list[dict[str, object]]):
    """A horizontal bar chart of :func:`wer_by_duration`'s ``rows`` (a matplotlib ``Figure``).

    WER (a fraction) on the x axis, one bar per duration bucket, shortest at the top.
    Built without pyplot, so no display or global figure state is involved.
    """
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.0, 1.5 + 0.4 * max(len(rows), 1)), layout="constrained")
    axes = figure.add_subplot()
    axes.barh([str(row["duration_bucket"]) for row in rows], [float(row["wer"]) for row in rows])
    axes.invert_yaxis()
    axes.set_xlabel("WER (fraction of reference words)")
    axes.set_ylabel("utterance duration")
    axes.set_title("Test WER by utterance duration")
    return figure


def metrics_dict(totals: Totals, rtf: dict[str, float] | None = None) -> dict[str, float | int]:
    """The flat numbers of ``metrics.json``; rates are fractions, durations seconds.

    ``rtf`` entries (real-time factors: processing seconds per audio second) appear as
    ``rtf_<name>`` (a name already starting with ``rtf`` is kept as it is).
    """
    words, chars = totals.words, totals.chars
    ref_words = max(words.ref_len, 1)
    metrics: dict[str, float | int] = {
        "wer": words.rate,
        "cer": chars.rate,
        "sub_rate": words.substitutions / ref_words,
        "del_rate": words.deletions / ref_words,
        "ins_rate": words.insertions / ref_words,
        "substitutions": words.substitutions,
        "deletions": words.deletions,
        "insertions": words.insertions,
        "word_errors": words.errors,
        "ref_words": words.ref_len,
        "char_substitutions": chars.substitutions,
        "char_deletions": chars.deletions,
        "char_insertions": chars.insertions,
        "ref_chars": chars.ref_len,
        "num_utterances": totals.num_utterances,
        "num_missing_hyps": totals.num_missing_hyps,
        "duration_s": totals.duration_s,
    }
    for name, value in (rtf or {}).items():
        metrics[name if name.startswith("rtf") else f"rtf_{name}"] = float(value)
    return metrics


def test_set_metrics(totals: Totals) -> dict[str, float | int]:
    """:data:`TEST_SET_KEYS` of one test set (rates are fractions, ``duration_s`` seconds)."""
    metrics = {**metrics_dict(totals), "char_errors": totals.chars.errors}
    return {key: metrics[key] for key in TEST_SET_KEYS}


def _totals(totals: Totals) -> list[str]:
    words, chars = totals.words, totals.chars
    lines = [
        f"WER {100 * words.rate:.2f}% ({words.errors} errors / {words.ref_len} words: "
        f"{words.substitutions} sub, {words.deletions} del, {words.insertions} ins) "
        f"on {totals.num_utterances} utterances",
        f"CER {100 * chars.rate:.2f}% ({chars.errors} errors / {chars.ref_len} characters: "
        f"{chars.substitutions} sub, {chars.deletions} del, {chars.insertions} ins)",
    ]
    if totals.num_missing_hyps:
        lines.append(f"{totals.num_missing_hyps} utterances had no hypothesis (scored as all deletions)")
    return lines


def _errors_text(report: ReportTotals, top_n: int) -> str:
    lines = _totals(report.pooled)
    if len(report.by_set) > 1:
        lines[0] += f" of {len(report.by_set)} test sets"
        for name, one in report.by_set.items():
            lines += ["", f"{name}:", *(f"  {line}" for line in _totals(one))]
    top = top_errors(report.errors, top_n)
    lines += ["", f"Most frequent word errors (top {top_n}):", f"{'count':>7}  error"]
    lines += [f"{count:>7}  {error}" for error, count in top] or ["      -  none"]
    return "\n".join(lines) + "\n"


def write_report(
    out_dir: Path,
    scores: Mapping[str, CorpusScore],
    durations: dict[str, float],
    *,
    rtf: dict[str, float] | None = None,
    top_n: int = TOP_ERRORS,
    loss_csv: Path | None = None,
) -> dict[str, float | int]:
    """Write the report files (see the module docstring) into ``out_dir`` from scores held in memory.

    Args:
        out_dir: folder for the files; created if missing.
        scores: each test set's name -> its score from
            :func:`asrflow.evaluation.metrics.score_corpus`, in the order to report them.
        durations: audio duration in seconds per utterance id.
        rtf: optional real-time factors by name (e.g. ``{"decode": 0.02}``).
        top_n: how many word errors ``errors.txt`` lists.
        loss_csv: the training's ``train_loss.csv``: given, the figures and the metrics
            table of :func:`write_figures` are written too (before ``metrics.json``).

    Returns:
        The metrics written to ``metrics.json``.
    """
    rows = ((name, row, durations.get(row.id)) for name, one in scores.items() for row in one.utterances)
    report = write_per_utterance(out_dir, scores, rows)
    return finish_report(out_dir, report, rtf=rtf, top_n=top_n, loss_csv=loss_csv)


def write_per_utterance(
    out_dir: Path, test_sets: Iterable[str], rows: Iterable[tuple[str, UtteranceScore, float | None]]
) -> ReportTotals:
    """Write ``per_utterance.jsonl`` into ``out_dir`` as ``rows`` come, each
    ``(test set, score, duration in seconds or None)``, one of ``test_sets`` (in report order).

    Only :class:`ReportTotals` is kept, so ``rows`` may be a stream of any length; the file is
    in their order and appears (atomically) once they are all written.

    Returns:
        The totals for :func:`finish_report`.
    """
    report = ReportTotals(test_sets)
    write_jsonl(Path(out_dir) / PER_UTTERANCE_FILE, (report.add(name, row, duration) for name, row, duration in rows))
    return report


def finish_report(
    out_dir: Path,
    report: ReportTotals,
    *,
    rtf: dict[str, float] | None = None,
    top_n: int = TOP_ERRORS,
    loss_csv: Path | None = None,
) -> dict[str, float | int]:
    """Write the report files after ``per_utterance.jsonl`` (:func:`write_per_utterance`): ``errors.txt``,
    ``wer_by_duration.csv``, the figures (with ``loss_csv``) and ``metrics.json`` last.

    Args: as :func:`write_report`'s.

    Returns:
        The metrics written to ``metrics.json``.
    """
    out_dir = Path(out_dir)
    if report.num_without_duration:
        logger.warning(
            "%d utterances have no duration (e.g. %s); left out of %s",
            report.num_without_duration,
            report.first_without_duration,
            WER_BY_DURATION_FILE,
        )
    with atomic_path(out_dir / ERRORS_FILE) as tmp:
        tmp.write_text(_errors_text(report, top_n))

    wer_rows = report.buckets.rows()
    with atomic_path(out_dir / WER_BY_DURATION_FILE) as tmp, open(tmp, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=WER_BY_DURATION_COLUMNS)
        writer.writeheader()
        writer.writerows(wer_rows)

    metrics = {
        **metrics_dict(report.pooled, rtf),
        TEST_SETS_KEY: {name: test_set_metrics(one) for name, one in report.by_set.items()},
    }
    if loss_csv is not None:
        write_figures(out_dir, metrics, wer_rows, loss_csv)
    write_json(out_dir / METRICS_FILE, metrics)
    return metrics


def train_loss_figure(loss_csv: Path):
    """A line chart of the training loss per optimizer step from ``train_loss.csv`` (``step,loss``).

    A missing or empty file gives an empty chart that says so.
    """
    from matplotlib.figure import Figure

    steps: list[int] = []
    losses: list[float] = []
    if Path(loss_csv).is_file():
        with open(loss_csv, newline="") as handle:
            for row in csv.DictReader(handle):
                steps.append(int(row["step"]))
                losses.append(float(row["loss"]))
    figure = Figure(figsize=(6.0, 3.5), layout="constrained")
    axes = figure.add_subplot()
    if steps:
        axes.plot(steps, losses, linewidth=1.0)
    else:
        axes.text(0.5, 0.5, f"no training loss in {loss_csv}", ha="center", va="center", transform=axes.transAxes)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("CTC loss (nats per token)")
    axes.set_title("Training loss per step")
    return figure


def metrics_table_html(metrics: dict) -> str:
    """A small self-contained HTML page: WER, CER and their counts per test set (``metrics["test_sets"]``),
    and, with more than one set, a last row for all of them pooled (``metrics``' top-level numbers)."""

    def pct(value: float) -> str:
        return f"{100 * float(value):.2f} %"

    test_sets = metrics[TEST_SETS_KEY]
    rows = list(test_sets.items())
    if len(rows) > 1:
        overall = {**metrics, "char_errors": sum(one["char_errors"] for one in test_sets.values())}
        rows.append((OVERALL, overall))
    body = "\n".join(
        f"<tr><th>{html.escape(name)}</th><td>{pct(one['wer'])}</td><td>{pct(one['cer'])}</td>"
        f"<td>{one['word_errors']} errors / {one['ref_words']} words</td>"
        f"<td>{one['char_errors']} errors / {one['ref_chars']} characters</td>"
        f"<td>{one['num_utterances']}</td><td>{float(one['duration_s']) / 60:.1f}</td></tr>"
        for name, one in rows
    )
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>Test WER and CER</title>'
        "<style>table{border-collapse:collapse;font-family:sans-serif}th,td{border:1px solid #ccc;"
        "padding:4px 10px;text-align:left}</style></head><body>\n"
        "<table>\n<tr><th>test set</th><th>WER</th><th>CER</th><th>word errors</th><th>character errors</th>"
        f"<th>utterances</th><th>audio (minutes)</th></tr>\n{body}\n</table>\n</body></html>\n"
    )


def _save_svg(figure, path: Path) -> None:
    import matplotlib

    with matplotlib.rc_context({"svg.hashsalt": "asrflow"}), atomic_path(path) as tmp:
        figure.savefig(tmp, format="svg", metadata={"Date": None})


def write_figures(out_dir: Path, metrics: dict, wer_rows: list[dict[str, object]], loss_csv: Path) -> None:
    """Write :data:`METRICS_TABLE_FILE`, :data:`WER_BY_DURATION_FIGURE_FILE` and
    :data:`TRAIN_LOSS_FIGURE_FILE` into ``out_dir`` (each atomically; SVGs without a date,
    so the same numbers give the same bytes)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_dir / METRICS_TABLE_FILE) as tmp:
        tmp.write_text(metrics_table_html(metrics))
    _save_svg(wer_by_duration_figure(wer_rows), out_dir / WER_BY_DURATION_FIGURE_FILE)
    _save_svg(train_loss_figure(loss_csv), out_dir / TRAIN_LOSS_FIGURE_FILE)
