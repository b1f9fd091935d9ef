"""The evaluate stage's work on a trained yesno model: report files, metrics, MLflow logging."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from trained_model import yesno_model  # noqa: F401  (fixture)

from asrflow.bundle import load_bundle
from asrflow.errors import AsrflowError
from asrflow.evaluation.evaluate import WER_FIGURE_ARTIFACT, WER_TABLE_ARTIFACT, EvaluateConfig, evaluate


def test_evaluate_writes_report_and_logs_to_the_training_run(yesno_model, yesno_data, tmp_path):  # noqa: F811
    uri = f"sqlite:///{yesno_model.parent / 'mlflow.db'}"
    metrics = evaluate(yesno_model, yesno_data / "fbank", tmp_path / "eval", EvaluateConfig(decoder="beam"), uri)

    on_disk = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert on_disk == pytest.approx(metrics)
    assert on_disk["num_utterances"] == 30 and on_disk["ref_words"] == 240
    assert 0.0 <= on_disk["wer"] < 0.25
    assert on_disk["rtf_greedy"] > 0 and on_disk["rtf_beam"] > 0
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


def test_unknown_decoder_is_a_user_error(yesno_model, yesno_data, tmp_path):  # noqa: F811
    with pytest.raises(AsrflowError, match="evaluate.decoder"):
        evaluate(yesno_model, yesno_data / "fbank", tmp_path / "eval", EvaluateConfig(decoder="viterbi"),
                 f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert not (tmp_path / "eval" / "metrics.json").exists()
