"""DVC experiments carry their metrics: with ``exp/eval/metrics.json`` committed (as DVC's own
example commits its metrics), ``dvc exp show`` lists WER and CER for the commit and for each
experiment, and ``dvc metrics diff`` compares them."""

from __future__ import annotations

import csv
import io
import json

import pytest

from tests.support.pipeline_tools import IDENTITY, run

pytestmark = pytest.mark.pipeline

METRICS = "exp/eval/metrics.json"


def test_experiments_show_and_diff_their_metrics(dvc_run):
    copy = dvc_run.copy
    ignored = run(copy, "git", "check-ignore", "-q", METRICS, check=False)
    assert ignored.returncode == 1, f"{METRICS} is git-ignored: no commit or experiment could hold it"
    run(copy, "git", *IDENTITY, "add", "-A")  # what a user commits after a run: dvc.lock and the metrics
    run(copy, "git", *IDENTITY, "commit", "-q", "-m", "baseline")

    # an experiment that re-runs evaluate only, in a temporary workspace (the copy stays as it is)
    run(copy, "dvc", "exp", "run", "--temp", "-n", "beam", "-S", "evaluate.decoder=beam", timeout=900)

    table = run(copy, "dvc", "exp", "show", "--csv", "--no-pager").stdout
    rows = list(csv.DictReader(io.StringIO(table[table.index("Experiment") :])))
    assert [row["Experiment"] for row in rows].count("beam") == 1 and len(rows) == 3, table  # workspace, HEAD, beam
    for row in rows:
        assert row["wer"] not in ("", "!") and row["cer"] not in ("", "!"), row

    diff = json.loads(run(copy, "dvc", "metrics", "diff", "--all", "--json", "HEAD").stdout)
    wer = diff[METRICS]["wer"]
    assert wer["old"] == wer["new"] == dvc_run.metrics["wer"]
    compared = json.loads(run(copy, "dvc", "exp", "diff", "HEAD", "beam", "--all", "--json").stdout)
    assert compared["params"]["params.yaml"]["evaluate.decoder"] == {"old": "greedy", "new": "beam"}
    assert compared["metrics"][METRICS]["wer"]["old"] == dvc_run.metrics["wer"], compared
