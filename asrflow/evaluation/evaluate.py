"""The evaluate stage's work: decode every test set with a model bundle, score, report, log."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TypeVar

from lhotse import CutSet
from lhotse.cut import Cut

from asrflow.data.features.config import check_same_features
from asrflow.data.manifests import cut_text, cuts_path, list_test_sets, load_cuts, pack_shortest_first
from asrflow.decoding.ctc import DECODER_KINDS, build_decoder
from asrflow.errors import AsrflowError
from asrflow.evaluation.metrics import score_utterance
from asrflow.evaluation.report import (
    TEST_SETS_KEY,
    WER_BY_DURATION_COLUMNS,
    finish_report,
    wer_by_duration_figure,
    write_per_utterance,
)
from asrflow.logs import progress
from asrflow.params import check_at_least, check_choice, check_positive, param_error
from asrflow.serving.bundle import Bundle, load_bundle
from asrflow.serving.device import DEVICE_NAMES, is_device_name, resolve_device
from asrflow.serving.inference import cut_features, log_probs
from asrflow.tokenizer import BLANK_ID

logger = logging.getLogger(__name__)

#: The params.yaml section :class:`EvaluateConfig` reads.
SECTION = "evaluate"

#: MLflow artifacts of the training run: WER by duration bucket as a table
#: (``mlflow.load_table``, the UI's table view) and as a bar chart.
WER_TABLE_ARTIFACT = "eval/wer_by_duration.json"
WER_FIGURE_ARTIFACT = "eval/wer_by_duration.png"

#: Test cuts read ahead, sorted by duration and packed into batches at a time: evaluation holds
#: at most this many cut manifests (not features) whatever the test sets' size; test sets that fit
#: in one window are batched exactly as a whole-set sort would. A window is many batches of typical
#: utterances, so sorting within it pads about as little as sorting the whole set would.
SORT_WINDOW = 2_000

T = TypeVar("T")
K = TypeVar("K")


@dataclass(frozen=True, kw_only=True)
class EvaluateConfig:
    """The ``evaluate:`` section of params.yaml, checked when built.

    Attributes:
        decoder: ``greedy`` or ``beam`` (:data:`asrflow.decoding.ctc.DECODER_KINDS`); the
            only decoder evaluation runs (``python -m bench.decode_rtf`` compares the speed of both).
        beam_size: prefixes kept per frame by beam search (1 or more).
        lm_path: a token-level KenLM ARPA/binary file fused into beam search, or ``None``;
            needs ``decoder: beam``.
        lm_weight: weight of the LM's log10-probability (0 or more; only with ``lm_path``).
        word_score: score added per word started (only with ``lm_path``; negative penalises words).
        max_batch_duration_s: seconds of audio decoded per batch (above 0).
        device: where the encoder runs: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``
            (:mod:`asrflow.serving.device`).
    """

    decoder: str = "greedy"
    beam_size: int = 8
    lm_path: str | None = None
    lm_weight: float = 0.5
    word_score: float = 0.0
    max_batch_duration_s: float = 200.0
    device: str = "auto"

    def __post_init__(self) -> None:
        check_choice(self, SECTION, "decoder", DECODER_KINDS)
        if not is_device_name(self.device):
            raise param_error(SECTION, "device", self.device, f"is not a device; use one of {', '.join(DEVICE_NAMES)}")
        check_at_least(self, SECTION, 1, "beam_size")
        check_positive(self, SECTION, "max_batch_duration_s")
        for key in ("lm_weight", "word_score"):
            if not math.isfinite(getattr(self, key)):
                raise param_error(SECTION, key, getattr(self, key), "must be a finite number")
        check_at_least(self, SECTION, 0, "lm_weight")
        if self.lm_path and self.decoder != "beam":
            raise param_error(
                SECTION,
                "lm_path",
                self.lm_path,
                f"needs evaluate.decoder: beam (evaluate.decoder = {self.decoder!r} uses no language model); "
                "set decoder: beam, or lm_path: null",
            )


def windowed_batches(
    items: Iterable[T], duration_s: Callable[[T], float], max_batch_duration_s: float, window: int = SORT_WINDOW
) -> Iterator[list[T]]:
    """Batches of at most ``max_batch_duration_s`` seconds of audio from a stream of ``items``.

    ``window`` items at a time are read, sorted by duration (seconds, stable: equal durations
    keep their order) and packed (:func:`asrflow.data.manifests.pack_shortest_first`); their
    batches are yielded before the next window is read. So at most ``window`` items are held
    whatever the stream's length, and a stream that fits in one window is batched as if it
    were sorted whole.
    """
    if window < 1:
        raise ValueError(f"window must be 1 or more, not {window}")
    stream = iter(items)
    while chunk := list(islice(stream, window)):
        yield from pack_shortest_first(chunk, duration_s, max_batch_duration_s)


def decoding_batches(cuts: Iterable[Cut], max_batch_duration_s: float, window: int = SORT_WINDOW) -> Iterator[CutSet]:
    """``cuts`` packed into batches of at most ``max_batch_duration_s`` seconds of audio,
    sorted by duration ``window`` cuts at a time (:func:`windowed_batches`)."""
    for batch in windowed_batches(cuts, lambda c: c.duration, max_batch_duration_s, window):
        yield CutSet.from_cuts(batch)


@dataclass
class DecodeTimes:
    """Seconds spent decoding so far, and the seconds of audio decoded."""

    encoder_s: float = 0.0
    decoder_s: float = 0.0
    audio_s: float = 0.0

    def rtf(self) -> dict[str, float]:
        """``rtf["encoder"]`` (features + CMVN + encoder seconds per audio second) and
        ``rtf["total"]`` (that plus the decoder's seconds)."""
        audio = max(self.audio_s, 1e-9)
        return {"encoder": self.encoder_s / audio, "total": (self.encoder_s + self.decoder_s) / audio}


def decode_stream(
    bundle: Bundle,
    tagged_cuts: Iterable[tuple[K, Cut]],
    config: EvaluateConfig,
    times: DecodeTimes,
    *,
    window: int = SORT_WINDOW,
) -> Iterator[tuple[K, Cut, str]]:
    """Decode ``(tag, cut)`` pairs with the decoder ``config`` names (only that one runs), as they stream.

    Batches are formed ``window`` cuts at a time (:func:`windowed_batches`), so memory does not grow
    with the stream's length. Yields ``(tag, cut, transcript)`` in decoding order (each cut once) and
    adds the time taken to ``times``.
    """
    decode = build_decoder(
        config.decoder,
        tokens=bundle.tokenizer.pieces,
        blank=BLANK_ID,
        beam_size=config.beam_size,
        lm_path=config.lm_path,
        lm_weight=config.lm_weight,
        word_score=config.word_score,
    )
    batches = windowed_batches(tagged_cuts, lambda item: item[1].duration, config.max_batch_duration_s, window)
    return _decode_batches(bundle, decode, batches, times)  # the decoder is built (and checked) before any batch


def _decode_batches(bundle: Bundle, decode, batches: Iterable[list[tuple[K, Cut]]], times: DecodeTimes):
    for batch in progress(batches, desc="decoding"):
        cuts = CutSet.from_cuts(cut for _, cut in batch)
        start = time.perf_counter()
        features, lengths = cut_features(bundle, cuts)
        scores, out_lens = log_probs(bundle, features, lengths)  # (N, T, V), (N,)
        times.encoder_s += time.perf_counter() - start
        start = time.perf_counter()
        token_ids = decode(scores, out_lens)
        times.decoder_s += time.perf_counter() - start
        for (tag, cut), ids in zip(batch, token_ids, strict=True):
            times.audio_s += cut.duration
            yield tag, cut, bundle.tokenizer.decode(ids)


def decode_split(
    bundle: Bundle, cuts: Iterable[Cut], config: EvaluateConfig
) -> tuple[dict[str, str], dict[str, float]]:
    """Hypotheses of the decoder ``config`` names (only that one runs), and its real-time factors,
    held in memory (:func:`decode_stream` streams them).

    Returns:
        ``(hyps, rtf)``: the transcript per cut id, and :meth:`DecodeTimes.rtf`.
    """
    times = DecodeTimes()
    hyps = {cut.id: hyp for _, cut, hyp in decode_stream(bundle, ((None, cut) for cut in cuts), config, times)}
    return hyps, times.rtf()


def evaluate(
    model_path: Path,
    fbank_dir: Path,
    out_dir: Path,
    config: EvaluateConfig,
    *,
    tracking_uri: str | None = None,
    window: int = SORT_WINDOW,
) -> dict:
    """Decode every test set of ``fbank_dir`` with ``config.decoder``, write the report into ``out_dir``,
    log it to the training's MLflow run (``tracking_uri``, else MLflow's default store).

    The test sets are decoded together (one real-time factor) and scored each on its own;
    the top-level numbers pool them (:func:`asrflow.evaluation.report.write_report`). They are
    streamed from their lazy manifests ``window`` cuts at a time (:func:`decode_stream`) and each
    utterance's row is written to ``per_utterance.jsonl`` as it is decoded, so memory stays flat
    in the test sets' size (:class:`asrflow.evaluation.report.ReportTotals` is all that is kept).

    Returns:
        The metrics written to ``metrics.json``.
    """
    bundle = load_bundle(model_path, device=resolve_device(config.device, f"params.yaml: {SECTION}.device"))
    check_same_features(bundle.features, fbank_dir)
    names = list_test_sets(fbank_dir)
    sets = {name: load_cuts(fbank_dir, name) for name in names}  # lazy: read as decoded
    tagged = ((name, cut) for name, one in sets.items() for cut in one)
    times = DecodeTimes()
    decoded = decode_stream(bundle, tagged, config, times, window=window)
    scored = ((name, score_utterance(cut.id, cut_text(cut), hyp), cut.duration) for name, cut, hyp in decoded)
    report = write_per_utterance(out_dir, names, scored)
    if report.pooled.words.ref_len == 0:
        raise AsrflowError(
            "there are no reference words to score against: are the test sets empty, or their transcripts?"
        )
    loss_csv = Path(out_dir).parent / "plots" / "train_loss.csv"
    metrics = finish_report(out_dir, report, rtf=times.rtf(), loss_csv=loss_csv)
    _log_results(metrics, decoder=config.decoder)
    if bundle.run_id:
        _log_to_training_run(
            bundle.run_id,
            metrics,
            wer_rows=report.buckets.rows(),
            out_dir=out_dir,
            tracking_uri=tracking_uri,
            test_manifests={name: cuts_path(fbank_dir, name) for name in sets},
        )
    return metrics


def _log_results(metrics: dict, *, decoder: str) -> None:
    """Log the pooled WER and CER (fractions, logged as percentages) of ``metrics`` (as written to
    ``metrics.json``), and each test set's when there are several."""
    test_sets = metrics[TEST_SETS_KEY]
    if len(test_sets) > 1:
        for name, one in test_sets.items():
            logger.info(
                "%s: WER %.2f%%, CER %.2f%% over %d utterances",
                name,
                100 * one["wer"],
                100 * one["cer"],
                one["num_utterances"],
            )
    logger.info(
        "test WER %.2f%%, CER %.2f%% over %d utterances of %d test set(s) (decoder %s)",
        100 * metrics["wer"],
        100 * metrics["cer"],
        metrics["num_utterances"],
        len(test_sets),
        decoder,
    )


def dataset_context(test_set: str) -> str:
    """The MLflow dataset context of a test set: ``test`` for the one named so, else ``test/<name>``."""
    return "test" if test_set == "test" else f"test/{test_set}"


def _log_to_training_run(
    run_id: str,
    metrics: dict,
    *,
    wer_rows: list[dict[str, object]],
    out_dir: Path,
    tracking_uri: str | None,
    test_manifests: dict[str, Path],
) -> None:
    """Log the pooled metrics (``test/<key>``), each test set's ``test/<name>/wer`` and
    ``test/<name>/cer``, the report files, the training loss CSV, and the WER by duration
    as an MLflow table (:data:`WER_TABLE_ARTIFACT`) and chart (:data:`WER_FIGURE_ARTIFACT`).

    Each test set's manifest becomes a dataset input of the run (context :func:`dataset_context`,
    named after the set); a set's metrics name its dataset (the pooled ones too when there is
    one set), and all are attached to the run's latest logged MLflow model when it has one.
    """
    from mlflow.tracking import MlflowClient

    from asrflow.tracking.run import MlflowRun

    tracker = MlflowRun.start(run_id=run_id, tracking_uri=tracking_uri, create_if_missing=True, run_name="evaluate")
    try:
        datasets = tracker.log_datasets(
            {dataset_context(name): path for name, path in test_manifests.items()},
            {dataset_context(name): name for name in test_manifests},
        )
        by_set = {name: datasets[dataset_context(name)] for name in test_manifests}
        model_ids = tracker.model_ids()
        model_id = model_ids[-1] if model_ids else None
        pooled = {f"test/{key}": value for key, value in metrics.items() if key != TEST_SETS_KEY}
        tracker.log_metrics(
            pooled, model_id=model_id, dataset=next(iter(by_set.values())) if len(by_set) == 1 else None
        )
        for name, one in metrics[TEST_SETS_KEY].items():
            per_set = {f"test/{name}/{key}": one[key] for key in ("wer", "cer")}
            tracker.log_metrics(per_set, model_id=model_id, dataset=by_set[name])
        for name in ("metrics.json", "per_utterance.jsonl", "errors.txt", "wer_by_duration.csv", "metrics.html"):
            tracker.log_artifact(out_dir / name, artifact_path="eval")
        loss_csv = Path(out_dir).parent / "plots" / "train_loss.csv"
        if loss_csv.is_file():
            tracker.log_artifact(loss_csv, artifact_path="plots")
        client = MlflowClient(tracking_uri=tracker.tracking_uri)
        columns = {key: [row[key] for row in wer_rows] for key in WER_BY_DURATION_COLUMNS}
        client.log_table(tracker.run_id, columns, WER_TABLE_ARTIFACT)
        client.log_figure(tracker.run_id, wer_by_duration_figure(wer_rows), WER_FIGURE_ARTIFACT)
    finally:
        tracker.end("FINISHED")
