"""What MLflow's UI shows of an asrflow run, on a real SQLite store: the experiment's kind,
run names and tags, dataset inputs, system metrics; and an unreachable tracking server."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lhotse import CutSet, MonoCut, Recording, SupervisionSegment
from lhotse.audio import AudioSource
from mlflow.tracking import MlflowClient

from asrflow.data.loading.index_store import combined_digest, manifest_facts
from asrflow.errors import AsrflowError
from asrflow.params import committed_params
from asrflow.tracking.naming import (
    DVC_EXP_TAG,
    NOTE_TAG,
    PARAMS_DIGEST_TAG,
    PIPELINE_TAG,
    params_digest,
    pipeline_tool,
    run_name,
    run_tags,
)
from asrflow.tracking.run import DATA_DIGEST_TAG, EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, MlflowRun, start_training_run
from asrflow.tracking.store import check_tracking_uri, runs_page
from tests.support.processes import free_port

REPO = Path(__file__).resolve().parents[1]
PARAMS = {"seed": 42, "train": {"lr": 0.001, "epochs": 40, "d_model": 144}, "evaluate": {"decoder": "greedy"}}


def write_cuts(path: Path, durations: list[float], prefix: str = "utt") -> Path:
    """A cut manifest of ``durations`` (metadata only: no audio is read)."""
    cuts = []
    for index, duration in enumerate(durations):
        uid = f"{prefix}{index}"
        recording = Recording(
            id=uid,
            sources=[AudioSource(type="file", channels=[0], source=f"/audio/{uid}.wav")],
            sampling_rate=16000,
            num_samples=int(duration * 16000),
            duration=duration,
        )
        supervision = SupervisionSegment(id=uid, recording_id=uid, start=0, duration=duration, text="YES NO")
        cuts.append(
            MonoCut(id=uid, start=0, duration=duration, channel=0, recording=recording, supervisions=[supervision])
        )
    CutSet.from_cuts(cuts).to_file(path)
    return path


# --------------------------------------------------------------------------- experiment kind
def test_new_experiment_opens_in_the_model_training_view(uri):
    tracker = MlflowRun.start(experiment="asrflow", tracking_uri=uri)
    tracker.end()
    experiment = MlflowClient(tracking_uri=uri).get_experiment_by_name("asrflow")
    assert experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"


def test_existing_experiment_gets_the_kind_but_a_chosen_kind_stays(uri):
    client = MlflowClient(tracking_uri=uri)
    old = client.create_experiment("old")
    chosen = client.create_experiment("chosen", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    for name in ("old", "chosen"):
        MlflowRun.start(experiment=name, tracking_uri=uri).end()
    assert client.get_experiment(old).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    assert client.get_experiment(chosen).tags[EXPERIMENT_KIND_TAG] == "genai_development"


# --------------------------------------------------------------------------- run names and tags
def test_run_name_from_dvc_experiment(monkeypatch):
    monkeypatch.setenv("DVC_EXP_NAME", "gusty-bass")
    assert run_name(PARAMS, PARAMS) == "gusty-bass"
    assert run_tags(PARAMS)[DVC_EXP_TAG] == "gusty-bass"


def test_run_name_from_changed_params(monkeypatch):
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    changed = json.loads(json.dumps(PARAMS))
    changed["train"]["lr"] = 0.002
    changed["train"]["epochs"] = 60
    assert run_name(changed, PARAMS) == "params epochs=60 lr=0.002"
    assert run_name(PARAMS, PARAMS) == run_name(PARAMS, None) == f"params-{params_digest(PARAMS)}"
    corpus = {"prepare": {"corpus": "folder"}, **PARAMS}
    assert run_name(corpus, None) == f"folder-{params_digest(corpus)}"


def test_run_names_are_short_and_tell_runs_apart_the_diff_is_the_description(monkeypatch):
    """Many keys that differ from the committed params: the name is the corpus and a digest, the keys go
    to the run's description."""
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    defaults = {"prepare": {"corpus": "yesno"}, "train": {f"key_number_{i}": 0 for i in range(20)}}
    names, notes = set(), set()
    for lr in (0.001, 0.002):
        params = {"prepare": {"corpus": "folder"}, "train": {f"key_number_{i}": i for i in range(20)}, "lr": lr}
        name = run_name(params, defaults)
        assert name == f"folder-{params_digest(params)}" and len(name) <= 20
        note = run_tags(params, defaults)[NOTE_TAG]
        assert "- `prepare.corpus`: yesno -> folder" in note and "- `train.key_number_19`: 0 -> 19" in note
        names.add(name)
        notes.add(note)
    assert len(names) == len(notes) == 2
    assert run_tags(defaults, defaults)[NOTE_TAG] == "The committed params.yaml, unchanged."


def test_params_digest_tells_params_apart():
    other = {**PARAMS, "seed": 1}
    assert params_digest(PARAMS) == params_digest(json.loads(json.dumps(PARAMS)))
    assert params_digest(PARAMS) != params_digest(other)
    assert len(params_digest(PARAMS)) == 8


def test_pipeline_tool_and_tags(monkeypatch):
    for name in ("ASRFLOW_PIPELINE", "DVC_STAGE", "DVC_EXP_NAME"):
        monkeypatch.delenv(name, raising=False)
    assert pipeline_tool() == "direct"
    monkeypatch.setenv("DVC_STAGE", "train")
    assert pipeline_tool() == "dvc"
    monkeypatch.delenv("DVC_STAGE")
    monkeypatch.setenv("ASRFLOW_PIPELINE", "snakemake")
    tags = run_tags(PARAMS)
    assert tags == {PIPELINE_TAG: "snakemake", PARAMS_DIGEST_TAG: params_digest(PARAMS)}


def test_committed_params_are_the_defaults(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "params.yaml").write_text("train:\n  lr: 0.001\n")
    git("add", "params.yaml")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "params")
    (tmp_path / "params.yaml").write_text("train:\n  lr: 0.005\n")
    assert committed_params(tmp_path / "params.yaml") == {"train": {"lr": 0.001}}
    assert run_name({"train": {"lr": 0.005}}, committed_params(tmp_path / "params.yaml")) == "params lr=0.005"
    assert committed_params(tmp_path / "missing.yaml") is None


@pytest.mark.slow
def test_run_carries_name_commit_and_tags(uri):
    code = (  # a process of its own, named as a stage is: MLflow resolves the git tags once per process
        "import sys; sys.argv[0] = 'stages/train.py'; from asrflow.tracking.run import MlflowRun; "
        "from asrflow.tracking.naming import run_name, run_tags; "
        f"params = {PARAMS!r}; run = MlflowRun.start(tracking_uri={uri!r}, run_name=run_name(params, None), "
        "tags=run_tags(params)); run.end(); print(run.run_id)"
    )
    env = {**os.environ, "ASRFLOW_PIPELINE": "snakemake", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    run = MlflowClient(tracking_uri=uri).get_run(done.stdout.split()[-1])
    assert run.info.run_name == f"params-{params_digest(PARAMS)}"
    assert run.data.tags[PIPELINE_TAG] == "snakemake"
    assert run.data.tags[PARAMS_DIGEST_TAG] == params_digest(PARAMS)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert run.data.tags["mlflow.source.git.commit"] == head  # MLflow's own context tags
    assert run.data.tags["mlflow.user"] and run.data.tags["mlflow.source.type"] == "LOCAL"


# --------------------------------------------------------------------------- datasets
def test_manifests_are_logged_as_dataset_inputs(uri, tmp_path):
    train = write_cuts(tmp_path / "train_cuts.jsonl.gz", [1800.0, 1800.0, 3600.0])
    dev = write_cuts(tmp_path / "dev_cuts.jsonl.gz", [5.0, 7.0], prefix="dev")
    tracker = MlflowRun.start(tracking_uri=uri)
    logged = tracker.log_datasets({"train": train, "dev": dev})
    tracker.log_datasets({"train": train, "dev": dev})  # a resumed run: nothing twice
    tracker.end()

    run = MlflowClient(tracking_uri=uri).get_run(tracker.run_id)
    inputs = {
        next(tag.value for tag in item.tags if tag.key == "mlflow.data.context"): item.dataset
        for item in run.inputs.dataset_inputs
    }
    assert len(run.inputs.dataset_inputs) == 2
    assert set(inputs) == {"train", "dev"}
    assert json.loads(inputs["train"].profile) == {"utterances": 3, "hours": 2.0}
    assert json.loads(inputs["dev"].profile) == {"utterances": 2, "hours": round(12 / 3600, 4)}
    assert inputs["train"].digest == manifest_digest(train) == logged["train"].digest
    assert json.loads(inputs["train"].source)["uri"] == str(train.resolve())
    assert inputs["train"].name == "train"
    assert run.data.tags[DATA_DIGEST_TAG] == combined_digest([manifest_digest(train), manifest_digest(dev)])


def manifest_digest(path: Path) -> str:
    return manifest_facts(path)["digest"]


def test_manifest_digest_is_of_the_content_not_the_gzip_header(tmp_path):
    first = write_cuts(tmp_path / "a.jsonl.gz", [1.0, 2.0])
    time.sleep(1.1)  # gzip records the time in whole seconds: a later copy gets another header
    second = tmp_path / "b.jsonl.gz"
    with gzip.open(first, "rb") as src, gzip.open(second, "wb") as dst:
        dst.write(src.read())
    assert first.read_bytes() != second.read_bytes()
    assert manifest_digest(first) == manifest_digest(second)
    third = write_cuts(tmp_path / "c.jsonl.gz", [1.0, 2.5])
    assert manifest_digest(third) != manifest_digest(first)


def test_missing_manifest_is_clear_error(uri, tmp_path):
    tracker = MlflowRun.start(tracking_uri=uri)
    with pytest.raises(AsrflowError, match=r"manifest .*nothere_cuts.jsonl.gz not found"):
        tracker.log_datasets({"train": tmp_path / "nothere_cuts.jsonl.gz"})
    tracker.end()


# --------------------------------------------------------------------------- system metrics
def test_system_metrics_by_mlflow_monitor(uri):
    tracker = MlflowRun.start(tracking_uri=uri, system_metrics=True, system_metrics_interval_s=0.2)
    client = MlflowClient(tracking_uri=uri)
    deadline = time.monotonic() + 60
    while (
        time.monotonic() < deadline
        and "system/cpu_utilization_percentage" not in client.get_run(tracker.run_id).data.metrics
    ):
        time.sleep(0.2)
    tracker.end()
    metrics = client.get_run(tracker.run_id).data.metrics
    assert "system/cpu_utilization_percentage" in metrics
    assert "system/system_memory_usage_megabytes" in metrics
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert not tracker.system_metrics_active


def test_mlflow_switch_turns_system_metrics_on_and_off(uri, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "")  # restored after the test
    mlflow.enable_system_metrics_logging()
    on = MlflowRun.start(tracking_uri=uri)
    assert on.system_metrics_active
    on.end()
    mlflow.disable_system_metrics_logging()
    off = start_training_run(PARAMS, {}, tracking_uri=uri)  # training asks for them; the switch says no
    assert off.run_id and not off.system_metrics_active
    off.end()


def test_runs_page_names_the_experiment():
    local = runs_page("sqlite:////data/mlflow.db", "3")
    assert local.startswith("http://127.0.0.1:5000/#/experiments/3/runs after `mlflow ui --backend-store-uri")
    assert "GenAI" in local
    assert runs_page("http://mlflow.example:8080/", "7").startswith("http://mlflow.example:8080/#/experiments/7/runs ")


# --------------------------------------------------------------------------- unreachable store
def test_unreachable_tracking_server_is_one_clear_error(monkeypatch):
    server = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    with pytest.raises(AsrflowError) as caught:
        MlflowRun.start(run_name="train")
    message = str(caught.value)
    assert server in message and "MLFLOW_TRACKING_URI" in message and "sqlite:///mlflow.db" in message
    assert "\n" not in message
    with pytest.raises(AsrflowError, match="cannot be reached"):
        check_tracking_uri(server)


@pytest.mark.slow
def test_train_stage_stops_before_training_when_the_server_is_unreachable(tmp_path):
    server = f"http://127.0.0.1:{free_port()}"
    shutil.copyfile(REPO / "params.yaml", tmp_path / "params.yaml")
    env = {"PATH": "/usr/bin:/bin", "MLFLOW_TRACKING_URI": server, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "stages.train", "--params", "params.yaml", "--exp", "exp"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and server in errors[0] and "unset MLFLOW_TRACKING_URI" in errors[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "exp").exists()


def test_start_training_does_what_the_ui_shows(uri, tmp_path, monkeypatch):
    """The one call the training loop makes: name, tags, datasets, system metrics; a resume
    continues the same run with nothing logged twice."""
    monkeypatch.chdir(tmp_path)  # no git here: the name falls back to the params digest
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    monkeypatch.setenv("ASRFLOW_PIPELINE", "snakemake")
    manifests = {
        "train": write_cuts(tmp_path / "train_cuts.jsonl.gz", [3.0, 4.0]),
        "dev": write_cuts(tmp_path / "dev_cuts.jsonl.gz", [2.0], prefix="dev"),
    }
    tracker = start_training_run(PARAMS, manifests, tracking_uri=uri, system_metrics_interval_s=0.2)
    assert tracker.run_id and tracker.system_metrics_active  # run_id waits for the opening
    tracker.end("KILLED")
    assert not tracker.system_metrics_active
    resumed = start_training_run(PARAMS, manifests, run_id=tracker.run_id, tracking_uri=uri, system_metrics=False)
    resumed.end()

    run = MlflowClient(tracking_uri=uri).get_run(tracker.run_id)
    assert run.info.run_name == f"params-{params_digest(PARAMS)}"
    assert run.data.tags[PIPELINE_TAG] == "snakemake"
    assert run.data.tags[DATA_DIGEST_TAG] == combined_digest(
        [manifest_digest(manifests["train"]), manifest_digest(manifests["dev"])]
    )
    assert len(run.inputs.dataset_inputs) == 2
    assert run.info.status == "FINISHED"


def test_start_training_with_a_missing_manifest_fails_the_run(uri, tmp_path):
    tracker = start_training_run(PARAMS, {"train": tmp_path / "train_cuts.jsonl.gz"}, tracking_uri=uri)
    tracker.record(1, {"train/loss": 1.0})  # opens the run in the background
    with pytest.raises(AsrflowError, match="train_cuts.jsonl.gz not found"):
        tracker.state_dict() if tracker.wait_open(60) else None
    tracker.end("FAILED")
    (run,) = MlflowClient(tracking_uri=uri).search_runs(
        [MlflowClient(tracking_uri=uri).get_experiment_by_name("asrflow").experiment_id]
    )
    assert run.info.status == "FAILED"
