"""The trained bundle as an MLflow model: logged to a real SQLite store, loaded with
``mlflow.pyfunc.load_model``, it transcribes yesno's test files; ``mlflow models serve``
answers a request (marked ``serve``: it starts a real server)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import soundfile
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from asrflow.data.loading.index_store import manifest_facts
from asrflow.data.manifests import cuts_path
from asrflow.errors import AsrflowError
from asrflow.evaluation.evaluate import EvaluateConfig, evaluate
from asrflow.evaluation.metrics import score_corpus
from asrflow.serving.bundle import load_bundle
from asrflow.serving.pyfunc import NO_KNOWN_COLUMN, log_bundle
from asrflow.tracking.run import MlflowRun
from tests.support.processes import free_port
from tests.support.servers import stop
from tests.support.trained_model import split_files

MAX_WER = 0.05
SERVE_TIMEOUT_S = 180


def wer(files: list[tuple[Path, str]], transcripts: list[str]) -> float:
    refs = {str(path): text for path, text in files}
    hyps = {str(path): text for (path, _), text in zip(files, transcripts, strict=True)}
    return score_corpus(refs, hyps).wer


@pytest.fixture(scope="module")
def logged(yesno_model, tmp_path_factory):
    """``(tracking uri, run id, ModelInfo)`` of the bundle logged as the model of a new run."""
    folder = tmp_path_factory.mktemp("mlflow_model")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    tracker = MlflowRun.start(experiment="asrflow", tracking_uri=uri, run_name="train")
    tracker.record(5, {"train/loss": 0.5})
    tracker.flush()
    info = tracker.log_model(yesno_model, registered_model_name="yesno-asr", step=5)
    tracker.end()
    return uri, tracker.run_id, info


@pytest.mark.slow
def test_logged_model_is_linked_to_the_run_with_signature_and_requirements(logged, monkeypatch):
    uri, run_id, info = logged
    client = MlflowClient(tracking_uri=uri)
    model = client.get_logged_model(info.model_id)
    assert model.source_run_id == run_id
    assert model.name == "model"
    assert str(model.status).endswith("READY")
    run = client.get_run(run_id)
    assert [output.model_id for output in run.outputs.model_outputs] == [info.model_id]
    assert {metric.key: metric.value for metric in model.metrics} == {"train/loss": 0.5}
    assert info.signature.inputs.input_names() == ["path", "waveform", "sample_rate"]
    assert info.signature.outputs.input_names() == ["transcript"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    local = Path(mlflow.artifacts.download_artifacts(info.model_uri))
    requirements = (local / "requirements.txt").read_text().split()
    assert any(line.startswith("torch==") for line in requirements)
    assert any(line.startswith("lhotse==") for line in requirements)
    assert (local / "code" / "asrflow" / "serving" / "bundle.py").is_file()
    versions = client.search_model_versions("name='yesno-asr'")
    assert [str(version.version) for version in versions] == ["1"]


def test_logged_model_lives_in_the_runs_experiment(logged):
    """The runs table's Model column lists the experiment's logged models: none may land in Default."""
    uri, run_id, info = logged
    client = MlflowClient(tracking_uri=uri)
    experiment_id = client.get_run(run_id).info.experiment_id
    assert client.get_experiment(experiment_id).name == "asrflow"
    found = client.search_logged_models(experiment_ids=[experiment_id])
    default = client.search_logged_models(experiment_ids=["0"])
    assert [model.model_id for model in found] == [info.model_id]
    assert found[0].experiment_id == experiment_id and default == []


def test_pyfunc_load_model_transcribes_yesno_test_files(logged, yesno_data, monkeypatch):
    uri, _, info = logged
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    model = mlflow.pyfunc.load_model(f"models:/{info.model_id}")
    files = split_files(yesno_data, "test")
    out = model.predict(pd.DataFrame({"path": [str(path) for path, _ in files]}))
    assert list(out.columns) == ["transcript"] and len(out) == len(files)
    assert wer(files, list(out["transcript"])) <= MAX_WER

    # One file the model gets right, alone, and as a waveform at the file's own rate (yesno is 8 kHz; the model
    # resamples to its 16 kHz): the same transcript whatever the input form or the batch.
    path, reference = next((path, ref) for (path, ref), hyp in zip(files, out["transcript"], strict=True) if hyp == ref)
    audio, rate = soundfile.read(path, dtype="float32")
    by_wave = model.predict(pd.DataFrame({"waveform": [audio.tolist()], "sample_rate": [rate]}))
    by_path = model.predict(pd.DataFrame({"path": [str(path)]}))
    assert by_path["transcript"][0] == reference
    assert by_wave["transcript"][0] == reference

    assert model.predict([{"path": str(path)}])["transcript"][0] == reference  # a list of rows

    registered = mlflow.pyfunc.load_model("models:/yesno-asr/1")
    assert registered.predict(pd.DataFrame({"path": [str(path)]}))["transcript"][0] == reference


def test_pyfunc_bad_input_names_the_item(logged, tmp_path, monkeypatch):
    uri, _, info = logged
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    model = mlflow.pyfunc.load_model(f"models:/{info.model_id}")
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    with pytest.raises(AsrflowError, match=r"nothere\.wav: no such file.*; .*empty\.wav: the file is empty") as error:
        model.predict(pd.DataFrame({"path": [str(tmp_path / "nothere.wav"), str(empty)]}))  # every bad file named
    # An MlflowException too, that ``mlflow models serve`` answers with a 400 and this message.
    assert isinstance(error.value, MlflowException) and error.value.error_code == "INVALID_PARAMETER_VALUE"
    with pytest.raises(AsrflowError, match="input row 0"):
        model.predict(pd.DataFrame({"sample_rate": [16000]}))
    with pytest.raises(AsrflowError, match="none of the columns path, waveform, sample_rate"):
        model.predict([str(tmp_path / "a.wav"), str(tmp_path / "b.wav")])  # a plain list: MLflow keeps no column


def test_missing_bundle_is_clear_error(tmp_path):
    with pytest.raises(AsrflowError, match="not found"):
        log_bundle(tmp_path / "model.pt", run_id="x", tracking_uri=f"sqlite:///{tmp_path}/m.db")


@pytest.fixture(scope="module")
def served(logged, tmp_path_factory):
    """The base URL of ``mlflow models serve`` running the logged model (one worker), up until the module ends."""
    uri, _, info = logged
    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    command = ["mlflow", "models", "serve", "-m", f"models:/{info.model_id}", "--env-manager", "local"]
    with open(log, "w") as handle:
        server = subprocess.Popen(
            [*command, "-h", "127.0.0.1", "-p", str(port), "-w", "1"],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while True:
            if server.poll() is not None:
                pytest.fail(f"mlflow models serve exited with {server.returncode}:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(f"{base}/ping", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow models serve not up after {SERVE_TIMEOUT_S} s:\n{log.read_text()}")
            time.sleep(0.5)
        yield base
    finally:
        stop(server)


def invoke(base: str, body: bytes) -> tuple[int, dict]:
    """POST ``body`` (JSON) to ``base/invocations``: the HTTP status and the answer read as JSON, errors too."""
    request = urllib.request.Request(f"{base}/invocations", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.serve
def test_mlflow_models_serve_answers(served, yesno_data):
    files = split_files(yesno_data, "test")[:3]
    status, answer = invoke(
        served, json.dumps({"dataframe_records": [{"path": str(path)} for path, _ in files]}).encode()
    )
    assert status == 200, answer
    transcripts = [row["transcript"] for row in answer["predictions"]]
    assert wer(files, transcripts) <= MAX_WER, answer


@pytest.mark.serve
def test_mlflow_models_serve_answers_a_bad_request_with_400_and_why(served, yesno_data, tmp_path):
    """Malformed JSON, rows naming files that are missing or not audio, and a plain list of paths (which MLflow
    empties): each a 400 whose message says what is wrong, and the server still answers the next request."""
    missing, corrupt = tmp_path / "nothere.wav", tmp_path / "corrupt.wav"
    corrupt.write_bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes())
    rows = {"dataframe_records": [{"path": str(missing)}, {"path": str(corrupt)}]}
    for body, expected in (
        (b'{"dataframe_records": [{"path": ', ["valid JSON"]),
        (json.dumps(rows).encode(), [f"{missing}: no such file", f"{corrupt}: cannot read audio"]),
        (json.dumps({"dataframe_records": [{"sample_rate": 16000}]}).encode(), ["input row 0: give 'path'"]),
        (json.dumps({"inputs": ["a.wav"]}).encode(), [NO_KNOWN_COLUMN]),
    ):
        status, answer = invoke(served, body)
        assert status == 400, (body, answer)
        assert answer["error_code"] in ("BAD_REQUEST", "INVALID_PARAMETER_VALUE"), answer
        for part in expected:
            assert part in answer["message"], (body, answer)
    good = {"dataframe_records": [{"path": str(split_files(yesno_data, "test")[0][0])}]}
    assert invoke(served, json.dumps(good).encode())[0] == 200


@pytest.mark.slow
def test_evaluate_attaches_test_metrics_and_dataset_to_the_model(yesno_model, yesno_data, tmp_path):
    """The training run (in a copy of its store) gets its model logged; evaluate then puts the
    test metrics on that model, naming the test manifest they were measured on."""
    shutil.copyfile(yesno_model.parent / "mlflow.db", tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = load_bundle(yesno_model).run_id
    tracker = MlflowRun.start(run_id=run_id, tracking_uri=uri)
    info = tracker.log_model(yesno_model)
    tracker.end()

    metrics = evaluate(yesno_model, yesno_data / "fbank", tmp_path / "eval", EvaluateConfig(), tracking_uri=uri)

    client = MlflowClient(tracking_uri=uri)
    model = client.get_logged_model(info.model_id)
    on_model = {metric.key: metric for metric in model.metrics}
    digest = manifest_facts(cuts_path(yesno_data / "fbank", "test"))["digest"]
    assert on_model["test/wer"].value == pytest.approx(metrics["wer"])
    assert on_model["test/wer"].dataset_name == "test" and on_model["test/wer"].dataset_digest == digest
    run = client.get_run(run_id)
    contexts = {
        tag.value: item.dataset.digest
        for item in run.inputs.dataset_inputs
        for tag in item.tags
        if tag.key == "mlflow.data.context"
    }
    assert contexts["test"] == digest
    assert run.info.status == "FINISHED"
