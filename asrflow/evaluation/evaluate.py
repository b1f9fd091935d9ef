"""The evaluate stage's work: decode every test set with a model bundle, score, report, log."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from lhotse import CutSet

from asrflow.data.features.config import check_same_features
from asrflow.data.manifests import cut_text, cuts_path, list_test_sets, load_cuts, pack_by_duration
from asrflow.decoding.ctc import DECODER_KINDS, build_decoder
from asrflow.evaluation.metrics import pool_scores, score_corpus
from asrflow.evaluation.report import (
    TEST_SETS_KEY,
    WER_BY_DURATION_COLUMNS,
    wer_by_duration,
    wer_by_duration_figure,
    write_report,
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


def decoding_batches(cuts: CutSet, max_batch_duration_s: float) -> list[CutSet]:
    """``cuts`` sorted by duration and packed into batches of at most ``max_batch_duration_s`` seconds of audio."""
    ordered = sorted(cuts, key=lambda c: c.duration)
    return [CutSet.from_cuts(batch) for batch in pack_by_duration(ordered, lambda c: c.duration, max_batch_duration_s)]


def decode_split(bundle: Bundle, cuts: CutSet, config: EvaluateConfig) -> tuple[dict[str, str], dict[str, float]]:
    """Hypotheses of the decoder ``config`` names (only that one runs), and its real-time factors.

    Returns:
        ``(hyps, rtf)``: the transcript per cut id, and ``rtf["encoder"]`` (features + CMVN +
        encoder seconds per audio second) and ``rtf["total"]`` (that plus the decoder's seconds).
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
    encoder_s = decoder_s = 0.0
    hyps: dict[str, str] = {}
    batches = decoding_batches(cuts, config.max_batch_duration_s)
    for batch in progress(batches, desc="decoding", total=len(batches)):
        start = time.perf_counter()
        features, lengths = cut_features(bundle, batch)
        scores, out_lens = log_probs(bundle, features, lengths)  # (N, T, V), (N,)
        encoder_s += time.perf_counter() - start
        start = time.perf_counter()
        token_ids = decode(scores, out_lens)
        decoder_s += time.perf_counter() - start
        for cut, ids in zip(batch, token_ids, strict=True):
            hyps[cut.id] = bundle.tokenizer.decode(ids)
    audio = max(sum(cut.duration for cut in cuts), 1e-9)
    return hyps, {"encoder": encoder_s / audio, "total": (encoder_s + decoder_s) / audio}


def evaluate(
    model_path: Path, fbank_dir: Path, out_dir: Path, config: EvaluateConfig, *, tracking_uri: str | None = None
) -> dict:
    """Decode every test set of ``fbank_dir`` with ``config.decoder``, write the report into ``out_dir``,
    log it to the training's MLflow run (``tracking_uri``, else MLflow's default store).

    The test sets are decoded together (one real-time factor) and scored each on its own;
    the top-level numbers pool them (:func:`asrflow.evaluation.report.write_report`).

    Returns:
        The metrics written to ``metrics.json``.
    """
    bundle = load_bundle(model_path, device=resolve_device(config.device, f"params.yaml: {SECTION}.device"))
    check_same_features(bundle.features, fbank_dir)
    sets = {name: load_cuts(fbank_dir, name).to_eager() for name in list_test_sets(fbank_dir)}
    cuts = CutSet.from_cuts(cut for one in sets.values() for cut in one)
    hyps, rtf = decode_split(bundle, cuts, config)
    scores = {name: score_corpus({cut.id: cut_text(cut) for cut in one}, hyps) for name, one in sets.items()}
    durations = {cut.id: cut.duration for cut in cuts}
    loss_csv = Path(out_dir).parent / "plots" / "train_loss.csv"
    metrics = write_report(out_dir, scores, durations, rtf=rtf, loss_csv=loss_csv)
    if len(sets) > 1:
        for name, one in metrics[TEST_SETS_KEY].items():
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
        len(cuts),
        len(sets),
        config.decoder,
    )
    if bundle.run_id:
        _log_to_training_run(
            bundle.run_id,
            metrics,
            wer_rows=wer_by_duration(pool_scores(scores.values()), durations),
            out_dir=out_dir,
            tracking_uri=tracking_uri,
            test_manifests={name: cuts_path(fbank_dir, name) for name in sets},
        )
    return metrics


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
