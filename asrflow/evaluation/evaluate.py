"""The evaluate stage's work: decode the test split with a model bundle, score, report, log."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from lhotse import CutSet

from asrflow.bundle import Bundle, load_bundle
from asrflow.data.manifests import cut_text, cuts_path, load_cuts, pack_by_duration
from asrflow.decoding.ctc import build_decoder
from asrflow.errors import AsrflowError
from asrflow.evaluation.metrics import score_corpus
from asrflow.evaluation.report import (
    WER_BY_DURATION_COLUMNS,
    wer_by_duration,
    wer_by_duration_figure,
    write_report,
)
from asrflow.inference import cut_features, log_probs
from asrflow.logs import progress
from asrflow.tokenizer import BLANK_ID

logger = logging.getLogger("asrflow.evaluate")

#: MLflow artifacts of the training run: WER by duration bucket as a table
#: (``mlflow.load_table``, the UI's table view) and as a bar chart.
WER_TABLE_ARTIFACT = "eval/wer_by_duration.json"
WER_FIGURE_ARTIFACT = "eval/wer_by_duration.png"


@dataclass(frozen=True)
class EvaluateConfig:
    """The ``evaluate:`` section of params.yaml."""

    decoder: str = "greedy"
    beam_size: int = 8
    lm_path: str | None = None
    lm_weight: float = 0.5
    word_score: float = 0.0
    max_batch_duration_s: float = 200.0


def decoding_batches(cuts: CutSet, max_batch_duration_s: float) -> list[CutSet]:
    """``cuts`` sorted by duration and packed into batches of at most ``max_batch_duration_s`` seconds of audio."""
    ordered = sorted(cuts, key=lambda c: c.duration)
    return [CutSet.from_cuts(batch) for batch in pack_by_duration(ordered, lambda c: c.duration, max_batch_duration_s)]


def decode_split(bundle: Bundle, cuts: CutSet, config: EvaluateConfig) -> tuple[dict[str, str], dict[str, float]]:
    """Hypotheses of the configured decoder, and real-time factors of greedy and beam decoding.

    Each RTF is (encoder seconds + that decoder's seconds) / audio seconds.
    """
    pieces = bundle.tokenizer.pieces
    decoders = {
        kind: build_decoder(kind, pieces, BLANK_ID, config.beam_size, config.lm_path, config.lm_weight,
                            config.word_score)
        for kind in ("greedy", "beam")
    }
    if config.decoder not in decoders:
        raise AsrflowError(f"params.yaml: evaluate.decoder = {config.decoder!r}; use greedy or beam")
    seconds = {"encoder": 0.0, "greedy": 0.0, "beam": 0.0}
    hyps: dict[str, str] = {}
    batches = decoding_batches(cuts, config.max_batch_duration_s)
    for batch in progress(batches, desc="decoding", total=len(batches)):
        start = time.perf_counter()
        features, lengths = cut_features(bundle, batch)
        scores, out_lens = log_probs(bundle, features, lengths)
        seconds["encoder"] += time.perf_counter() - start
        results = {}
        for name, decode in decoders.items():
            start = time.perf_counter()
            results[name] = decode(scores, out_lens)
            seconds[name] += time.perf_counter() - start
        for cut, ids in zip(batch, results[config.decoder], strict=True):
            hyps[cut.id] = bundle.tokenizer.decode(ids)
    audio = sum(cut.duration for cut in cuts)
    rtf = {name: (seconds["encoder"] + seconds[name]) / max(audio, 1e-9) for name in ("greedy", "beam")}
    return hyps, rtf


def evaluate(model_path: Path, fbank_dir: Path, out_dir: Path, config: EvaluateConfig,
             tracking_uri: str | None = None) -> dict:
    """Decode ``fbank_dir``'s test split, write the report into ``out_dir``, log it to MLflow."""
    bundle = load_bundle(model_path)
    cuts = load_cuts(fbank_dir, "test").to_eager()
    refs = {cut.id: cut_text(cut) for cut in cuts}
    hyps, rtf = decode_split(bundle, cuts, config)
    score = score_corpus(refs, hyps)
    durations = {cut.id: cut.duration for cut in cuts}
    metrics = write_report(out_dir, score, durations, rtf, loss_csv=Path(out_dir).parent / "plots" / "train_loss.csv")
    logger.info("test WER %.2f%%, CER %.2f%% over %d utterances (decoder %s)",
                100 * score.wer, 100 * score.cer, len(cuts), config.decoder)
    if bundle.run_id:
        _log_to_training_run(
            bundle.run_id, metrics, wer_by_duration(score, durations), out_dir, tracking_uri,
            cuts_path(fbank_dir, "test"),
        )
    return metrics


def _log_to_training_run(
    run_id: str, metrics: dict, wer_rows: list[dict[str, object]], out_dir: Path, tracking_uri: str | None,
    test_manifest: Path,
) -> None:
    """Log the metrics (``test/*``), the report files, the training loss CSV, and the WER by
    duration as an MLflow table (:data:`WER_TABLE_ARTIFACT`) and chart (:data:`WER_FIGURE_ARTIFACT`).

    The test manifest becomes the run's ``test`` dataset input; the metrics name it and are
    attached to the run's latest logged MLflow model, when it has one (its page shows them).
    """
    from mlflow.tracking import MlflowClient

    from asrflow.tracking import RunTracker

    tracker = RunTracker.start(run_id=run_id, tracking_uri=tracking_uri, create_if_missing=True, run_name="evaluate")
    try:
        test_set = tracker.log_datasets({"test": test_manifest})["test"]
        model_ids = tracker.model_ids()
        tracker.log_metrics(
            {f"test/{key}": value for key, value in metrics.items()},
            model_id=model_ids[-1] if model_ids else None, dataset=test_set,
        )
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
