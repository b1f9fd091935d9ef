"""The evaluate stage's work on a trained yesno model: report files, metrics, MLflow logging."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from asrflow.data.features.extract import compute_features
from asrflow.data.manifests import list_test_sets, load_cuts
from asrflow.data.prepare.config import PrepareConfig
from asrflow.data.prepare.corpus import prepare_corpus
from asrflow.decoding.ctc import greedy_decode, prefix_beam_search
from asrflow.errors import AsrflowError
from asrflow.evaluation.evaluate import (
    WER_FIGURE_ARTIFACT,
    WER_TABLE_ARTIFACT,
    EvaluateConfig,
    decode_split,
    decoding_batches,
    evaluate,
    windowed_batches,
)
from asrflow.serving.bundle import load_bundle
from asrflow.serving.device import resolve_device
from asrflow.serving.inference import cut_features, log_probs
from asrflow.tokenizer import BLANK_ID
from tests.support.corpora import feature_config, write_folder_corpus
from tests.support.trained_model import split_files


@pytest.mark.slow
def test_evaluate_writes_report_and_logs_to_the_training_run(yesno_model, yesno_data, tmp_path):  # noqa: F811
    uri = f"sqlite:///{yesno_model.parent / 'mlflow.db'}"
    metrics = evaluate(
        yesno_model, yesno_data / "fbank", tmp_path / "eval", EvaluateConfig(decoder="beam"), tracking_uri=uri
    )

    on_disk = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert on_disk == metrics
    assert on_disk["num_utterances"] == 30 and on_disk["ref_words"] == 240
    assert 0.0 <= on_disk["wer"] < 0.25
    # Only the chosen decoder ran: one end-to-end real-time factor, and the encoder's share of it.
    assert sorted(key for key in on_disk if key.startswith("rtf")) == ["rtf_encoder", "rtf_total"]
    assert 0 < on_disk["rtf_encoder"] <= on_disk["rtf_total"]
    rows = [json.loads(line) for line in (tmp_path / "eval" / "per_utterance.jsonl").read_text().splitlines()]
    assert len(rows) == 30 and {"id", "ref", "hyp", "duration"} <= set(rows[0])
    assert (tmp_path / "eval" / "wer_by_duration.csv").read_text().startswith("duration_bucket,wer")

    run_id = load_bundle(yesno_model).run_id
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.data.metrics["test/wer"] == pytest.approx(on_disk["wer"])
    assert run.data.metrics["test/cer"] == pytest.approx(on_disk["cer"])
    assert run.info.status == "FINISHED"

    # WER by duration: a table MLflow knows (tagged for the UI) with the CSV's rows, and a chart.
    assert WER_TABLE_ARTIFACT in run.data.tags.get("mlflow.loggedArtifacts", "")
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    table = json.loads(Path(client.download_artifacts(run_id, WER_TABLE_ARTIFACT, str(downloads))).read_text())
    with open(tmp_path / "eval" / "wer_by_duration.csv", newline="") as handle:
        csv_rows = list(csv.DictReader(handle))
    assert table["columns"] == ["duration_bucket", "wer", "num_utterances"]
    assert csv_rows and table["data"] == [
        [row["duration_bucket"], float(row["wer"]), int(row["num_utterances"])] for row in csv_rows
    ]
    png = Path(client.download_artifacts(run_id, WER_FIGURE_ARTIFACT, str(downloads))).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


def test_every_test_set_is_scored_and_the_overall_pools_them(yesno_model, yesno_data, tmp_path):  # noqa: F811
    """yesno's 30 test utterances as two named test sets of a folder corpus (12 + 18), through
    prepare, features and evaluate: a row per set, and an overall that is yesno's single test set."""
    test = split_files(yesno_data, "test")
    splits = {"train": split_files(yesno_data, "train"), "dev": split_files(yesno_data, "dev")}
    corpus = write_folder_corpus(tmp_path / "corpus", {**splits, "first": test[:12], "second": test[12:]})
    named = {"train": "train", "dev": "dev", "test": {"first": "first", "more/second": "second"}}
    prepare = PrepareConfig.from_section({"corpus": "folder", "corpus_dir": str(corpus), "splits": named})
    prepare_corpus(prepare, tmp_path / "manifests", seed=42)
    compute_features(tmp_path / "manifests", tmp_path / "fbank", feature_config(num_jobs=1))
    assert list_test_sets(tmp_path / "fbank") == ["first", "more/second"]

    uri = f"sqlite:///{yesno_model.parent / 'mlflow.db'}"
    single = evaluate(yesno_model, yesno_data / "fbank", tmp_path / "single", EvaluateConfig(), tracking_uri=uri)
    metrics = evaluate(yesno_model, tmp_path / "fbank", tmp_path / "eval", EvaluateConfig(), tracking_uri=uri)

    assert json.loads((tmp_path / "eval" / "metrics.json").read_text()) == metrics
    sets = metrics["test_sets"]
    assert list(sets) == ["first", "more/second"]
    assert [(sets[name]["num_utterances"], sets[name]["ref_words"]) for name in sets] == [(12, 96), (18, 144)]
    rows = [json.loads(line) for line in (tmp_path / "eval" / "per_utterance.jsonl").read_text().splitlines()]
    for name, one in sets.items():
        mine = [row for row in rows if row["test_set"] == name]
        assert len(mine) == one["num_utterances"] and sum(row["errors"] for row in mine) == one["word_errors"]
    # Pooled: every set's errors over every set's words, the same as yesno's one test set of these utterances.
    assert metrics["word_errors"] == sum(one["word_errors"] for one in sets.values()) == single["word_errors"]
    assert metrics["wer"] == pytest.approx(metrics["word_errors"] / 240) == pytest.approx(single["wer"])
    assert metrics["cer"] == pytest.approx(single["cer"]) and metrics["num_utterances"] == 30
    assert list(single["test_sets"]) == ["test"]
    table = (tmp_path / "eval" / "metrics.html").read_text()
    assert all(f"<tr><th>{name}</th>" in table for name in ("first", "more/second", "overall"))

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(load_bundle(yesno_model).run_id)
    for name, one in sets.items():
        assert run.data.metrics[f"test/{name}/wer"] == pytest.approx(one["wer"])
        assert run.data.metrics[f"test/{name}/cer"] == pytest.approx(one["cer"])
    assert run.data.metrics["test/test/wer"] == pytest.approx(single["wer"])  # the one set of yesno's own layout
    assert run.data.metrics["test/wer"] == pytest.approx(metrics["wer"])
    contexts = {
        tag.value for item in run.inputs.dataset_inputs for tag in item.tags if tag.key == "mlflow.data.context"
    }
    assert {"test", "test/first", "test/more/second"} <= contexts


def test_only_the_chosen_decoder_runs(yesno_model, yesno_data):  # noqa: F811
    """Greedy evaluation gives greedy_decode's output; beam gives prefix_beam_search's (no LM set)."""
    bundle = load_bundle(yesno_model)
    cuts = load_cuts(yesno_data / "fbank", "test").to_eager().subset(first=6)
    [batch] = decoding_batches(cuts, EvaluateConfig().max_batch_duration_s)  # the batch decode_split makes
    features, lengths = cut_features(bundle, batch)
    scores, out_lens = log_probs(bundle, features, lengths)
    expected = {
        "greedy": greedy_decode(scores, out_lens, blank=BLANK_ID),
        "beam": prefix_beam_search(scores, out_lens, 3, blank=BLANK_ID),
    }
    for decoder, token_ids in expected.items():
        hyps, rtf = decode_split(bundle, cuts, EvaluateConfig(decoder=decoder, beam_size=3))
        assert hyps == {cut.id: bundle.tokenizer.decode(ids) for cut, ids in zip(batch, token_ids, strict=True)}
        assert sorted(rtf) == ["encoder", "total"]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_evaluation_on_a_device_gives_the_cpu_s_transcripts(yesno_model, yesno_data, device):  # noqa: F811
    """evaluate.device: the bundle's model on that device, the decoders on its log-probabilities back on the
    CPU; every transcript is the one a CPU-only run gives."""
    cuts = load_cuts(yesno_data / "fbank", "test").to_eager()
    on_cpu, _ = decode_split(load_bundle(yesno_model), cuts, EvaluateConfig())
    bundle = load_bundle(yesno_model, device=resolve_device(device, "evaluate.device"))
    assert bundle.model.head.weight.device.type == device
    on_device, _ = decode_split(bundle, cuts, EvaluateConfig(device=device))
    assert on_device == on_cpu


def test_a_missing_language_model_stops_evaluation_before_writing(yesno_model, yesno_data, tmp_path):  # noqa: F811
    config = EvaluateConfig(decoder="beam", lm_path=str(tmp_path / "missing.arpa"))
    with pytest.raises(AsrflowError, match="missing.arpa"):
        evaluate(
            yesno_model,
            yesno_data / "fbank",
            tmp_path / "eval",
            config,
            tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
        )
    assert not (tmp_path / "eval").exists()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"decoder": "viterbi"}, "evaluate.decoder = 'viterbi' is not valid; use one of greedy, beam"),
        ({"beam_size": 0}, "evaluate.beam_size = 0 must be at least 1"),
        ({"max_batch_duration_s": 0.0}, "evaluate.max_batch_duration_s = 0.0 must be greater than 0"),
        ({"lm_weight": -0.5}, "evaluate.lm_weight = -0.5 must be at least 0"),
        ({"word_score": float("nan")}, "evaluate.word_score = nan must be a finite number"),
        ({"lm_path": "lm.arpa"}, "evaluate.lm_path = 'lm.arpa' needs evaluate.decoder: beam"),
    ],
)
def test_bad_settings_name_the_key(settings, message):
    with pytest.raises(AsrflowError, match=re.escape(f"params.yaml: {message}")):
        EvaluateConfig(**settings)


def test_lm_settings_are_accepted_with_beam_search():
    config = EvaluateConfig(decoder="beam", lm_path="lm.arpa", lm_weight=0.0, word_score=-1.5)
    assert config.lm_path == "lm.arpa" and config.word_score == -1.5


def test_packing_holds_at_most_one_window_of_a_lazy_stream():
    """windowed_batches reads a window, sorts and packs it, yields its batches before reading on."""
    durations = [(i * 7919) % 13 + 0.5 for i in range(101)]  # seconds, in no order
    pulled = 0

    def stream():
        nonlocal pulled
        for index, seconds in enumerate(durations):
            pulled += 1
            yield index, seconds

    emitted: list[int] = []
    for batch in windowed_batches(stream(), lambda item: item[1], 20.0, window=10):
        assert sum(seconds for _, seconds in batch) <= 20.0 or len(batch) == 1
        assert [seconds for _, seconds in batch] == sorted(seconds for _, seconds in batch)
        emitted += [index for index, _ in batch]
        assert pulled - len(emitted) < 10  # never more than a window ahead of the batches emitted
    assert sorted(emitted) == list(range(len(durations)))
    # One window over everything: the whole-set sort of old (stable for equal durations).
    whole = [index for batch in windowed_batches(stream(), lambda item: item[1], 20.0) for index, _ in batch]
    assert whole == sorted(range(len(durations)), key=lambda i: durations[i])


@pytest.mark.slow
def test_a_test_set_larger_than_the_window_gives_the_one_window_results(yesno_model, yesno_data, tmp_path):  # noqa: F811
    """Lazy test sets in windows of 7 cuts: each of the 30 utterances decoded once, the same transcripts and
    metrics as one window (apart from timing)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    results = {}
    for window in (7, 10_000):
        out = tmp_path / f"eval{window}"
        metrics = evaluate(yesno_model, yesno_data / "fbank", out, EvaluateConfig(), tracking_uri=uri, window=window)
        rows = [json.loads(line) for line in (out / "per_utterance.jsonl").read_text().splitlines()]
        ids = [row["id"] for row in rows]
        assert len(ids) == len(set(ids)) == 30
        timing_free = {key: value for key, value in metrics.items() if not key.startswith("rtf")}
        results[window] = ({row["id"]: row["hyp"] for row in rows}, timing_free, (out / "errors.txt").read_text())
    assert results[7] == results[10_000]
