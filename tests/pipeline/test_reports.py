"""What a user looks at after ``dvc repro``: ``dvc plots show``, ``dvc metrics show``, and
``asrflow transcribe`` with the model the pipeline trained.

Read-only: the DVC copy stays as its run left it.
"""

from __future__ import annotations

import csv
import math
import re
import shutil
from pathlib import Path

import pytest

from asrflow.data.manifests import cut_text, load_cuts
from asrflow.evaluation.metrics import score_corpus
from tests.support.pipeline_tools import VENV_BIN, dvc_json, read_metrics, run

pytestmark = pytest.mark.pipeline

LOSS_PLOT = "exp/plots/train_loss.csv"
WER_PLOT = "exp/eval/wer_by_duration.csv"
# Bucket labels of asrflow.evaluation.report: "5-6s", "0.5-1s".
BUCKET_LABEL = re.compile(r"^\d+(\.\d+)?-\d+(\.\d+)?s$")
#: Word error rate `asrflow transcribe` must stay under on the test split's audio files.
MAX_TRANSCRIBE_WER = 0.05


def channels(spec: dict) -> dict[str, set[tuple[str, str]]]:
    """``{"x": {(field, type), ...}, "y": ...}`` over every ``encoding`` of a Vega-Lite spec,
    layers included (DVC's line template puts y in its layers)."""
    found: dict[str, set[tuple[str, str]]] = {"x": set(), "y": set()}

    def walk(node) -> None:
        if isinstance(node, dict):
            for name, channel in (node.get("encoding") or {}).items():
                if name in found and isinstance(channel, dict) and "field" in channel:
                    found[name].add((channel["field"], channel.get("type")))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(spec)
    return found


@pytest.fixture(scope="module")
def plots(dvc_run) -> dict[str, dict]:
    """``dvc plots show --json``'s Vega-Lite spec per plot id."""
    shown = dvc_json(dvc_run.copy, "plots", "show")
    assert not shown.get("errors"), shown["errors"]
    specs = {}
    for plot_id, renders in shown["data"].items():
        (render,) = renders
        assert render["type"] == "vega", render
        specs[plot_id] = render["content"]
    return specs


def test_dvc_shows_both_plots_with_the_axes_they_mean(plots):
    assert set(plots) == {LOSS_PLOT, WER_PLOT}
    assert channels(plots[LOSS_PLOT]) == {"x": {("step", "quantitative")}, "y": {("loss", "quantitative")}}
    assert channels(plots[WER_PLOT]) == {"x": {("wer", "quantitative")}, "y": {("duration_bucket", "nominal")}}


def test_plot_data_are_the_files_and_numbers_sit_on_numeric_axes(plots, dvc_run):
    for plot_id, spec in plots.items():
        values = spec["data"]["values"]
        with open(dvc_run.copy / plot_id, newline="") as handle:
            rows = list(csv.DictReader(handle))
        assert rows, f"{plot_id} is empty"
        assert [{k: v for k, v in value.items() if k != "rev"} for value in values] == rows, plot_id
        for channel in channels(spec).values():
            for field, kind in channel:
                if kind == "quantitative":
                    numbers = [float(value[field]) for value in values]  # a label such as "5-6s" fails here
                    assert all(math.isfinite(number) for number in numbers), (plot_id, field)

    steps = [int(value["step"]) for value in plots[LOSS_PLOT]["data"]["values"]]
    assert steps == sorted(set(steps)), "training loss steps must rise"
    buckets = plots[WER_PLOT]["data"]["values"]
    assert all(BUCKET_LABEL.match(value["duration_bucket"]) for value in buckets), buckets
    assert all(float(value["wer"]) >= 0.0 for value in buckets), buckets
    metrics = read_metrics(dvc_run.copy)
    assert sum(int(value["num_utterances"]) for value in buckets) == metrics["num_utterances"]


def test_dvc_metrics_show_has_wer_and_cer(dvc_run):
    shown = dvc_json(dvc_run.copy, "metrics", "show")
    workspace = shown[""]
    assert not workspace.get("error"), workspace
    assert list(workspace["data"]) == ["exp/eval/metrics.json"]
    metrics = workspace["data"]["exp/eval/metrics.json"]["data"]
    assert {"wer", "cer", "rtf_total", "rtf_encoder"} <= set(metrics)
    assert metrics == read_metrics(dvc_run.copy)


def test_transcribe_with_the_pipeline_model_outside_the_repo(dvc_run, tmp_path):
    """``asrflow transcribe`` on the test split's audio, with a copy of exp/model.pt elsewhere."""
    copy = dvc_run.copy
    shutil.copy(copy / "exp/model.pt", tmp_path / "model.pt")
    refs = {}
    for cut in load_cuts(copy / "data/manifests", "test"):
        source = Path(cut.recording.sources[0].source)
        audio = tmp_path / "audio" / source.name
        audio.parent.mkdir(exist_ok=True)
        shutil.copy(source if source.is_absolute() else copy / source, audio)
        refs[f"audio/{source.name}"] = cut_text(cut)
    assert len(refs) == dvc_run.metrics["num_utterances"]

    result = run(tmp_path, str(VENV_BIN / "asrflow"), "transcribe", "--model", "model.pt", *refs, timeout=300)
    rows = [line.split("\t") for line in result.stdout.splitlines() if "\t" in line]
    hyps = dict(rows)
    assert [path for path, _ in rows] == list(refs), result.stdout
    wer = score_corpus(refs, hyps).wer
    assert wer <= MAX_TRANSCRIBE_WER, f"transcribe WER {wer:.3f}:\n{result.stdout}"


def test_snakemake_report_has_the_wer_table_and_both_figures(snakemake_run):
    """``snakemake --report report.html``: one self-contained file embedding the WER/CER table,
    the training-loss curve and the WER-by-duration chart (as base64 data)."""
    import base64

    copy = snakemake_run.copy
    report = copy / "report.html"
    try:
        run(copy, "snakemake", "--report", str(report), timeout=300)
        html = report.read_text()
        for name in ("exp/eval/metrics.html", "exp/eval/train_loss.svg", "exp/eval/wer_by_duration.svg"):
            content = base64.b64encode((copy / name).read_bytes()).decode()
            assert content in html, f"{name} is not embedded in the report"
        assert "Training loss per step" in (copy / "exp/eval/train_loss.svg").read_text()
        assert "Evaluation" in html and "Training" in html
    finally:
        report.unlink(missing_ok=True)


def test_snakemake_terminal_shows_progress_and_mlflow_knows_the_run(snakemake_run):
    """The terminal names each stage's log, shows training steps and the test WER; MLflow's experiment opens in the
    model-training view and the run has the test split as a dataset input."""
    from mlflow.tracking import MlflowClient

    from asrflow.tracking.run import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG

    output = snakemake_run.output
    for stage in ("prepare", "features", "tokenizer", "train", "evaluate"):
        assert f"[{stage}] running; full log in logs/{stage}.log" in output
    assert re.search(r"\[train\] step \d+/\d+ \(\d+%\) epoch \d+: loss ", output), "no training step line"
    assert "[evaluate] test WER" in output
    client = MlflowClient(tracking_uri=f"sqlite:///{snakemake_run.copy}/mlflow.db")
    experiment = client.get_experiment_by_name("asrflow")
    assert experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    (run_info,) = client.search_runs([experiment.experiment_id])
    contexts = {tag.value for item in run_info.inputs.dataset_inputs for tag in item.tags}
    assert "test" in contexts
