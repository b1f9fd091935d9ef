"""bench.accuracy_at_time: each variant trained for its minutes by the train stage, then scored on the test split."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from asrflow.data.manifests import cut_text, list_test_sets, load_cuts
from asrflow.evaluation.metrics import score_corpus
from bench.accuracy_at_time import main, variant
from bench.startup import metric_points


def check_scored_run(found: dict, run_dir: Path, data: Path) -> None:
    """``found``'s figures (a record's side trained in ``run_dir`` on ``data``) are the run's: its WER and CER are
    asrflow's scorer's for the hypotheses its evaluation decoded, one for each of ``data``'s test utterances,
    against the corpus' own transcripts; it took steps, and its train loss fell from the first (a loaded machine
    may leave it one step, or a few, in the quick mode's seconds: too few to leave CTC's blank plateau)."""
    fbank = data / "fbank"
    refs = {cut.id: cut_text(cut) for name in list_test_sets(fbank) for cut in load_cuts(fbank, name)}
    rows = (json.loads(line) for line in (run_dir / "exp" / "eval" / "per_utterance.jsonl").read_text().splitlines())
    hyps = {row["id"]: row["hyp"] for row in rows}
    assert len(refs) == 30 and hyps.keys() == refs.keys()  # yesno's 30 test files, each decoded
    score = score_corpus(refs, hyps)
    assert (found["wer"], found["cer"]) == (pytest.approx(score.wer, abs=1e-4), pytest.approx(score.cer, abs=1e-4))
    losses = {step: loss for step, (_, loss) in metric_points(run_dir / "mlflow.db", "train/loss").items()}
    assert found["steps"] > 0 and (len(losses) == 1 or losses[max(losses)] < losses[min(losses)]), losses  # it trained


def test_a_variant_is_a_name_and_dotted_overrides():
    assert variant('lr1e-3={"train.optim.lr": 0.001}') == ("lr1e-3", {"train.optim.lr": 0.001})
    assert variant("shipped=") == ("shipped", {})
    for bad in ('{"train.optim.lr": 0.001}', "=", 'a/b={"train.optim.lr": 0.001}'):
        with pytest.raises(argparse.ArgumentTypeError, match="expected NAME=JSON"):
            variant(bad)
    for bad in ("lr=0.001", "lr=[0.001]"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a JSON object|not JSON"):
            variant(bad)


@pytest.mark.pipeline
def test_quick_run_trains_stops_and_scores_each_variant(tmp_path):
    overrides = {"train.model.attention": "rel_pos"}
    records = main(["--quick", "--workdir", str(tmp_path), "--variant", f"rel_pos={json.dumps(overrides)}"])
    (found,) = [record for record in records if record["benchmark"] == "accuracy_at_time"]
    assert found["variant"] == "rel_pos" and found["overrides"] == overrides
    assert found["train_exit_code"] == 75  # stopped by SIGTERM at its time, its step saved
    check_scored_run(found, tmp_path / "accuracy-rel_pos", Path(found["data"]))
    assert (tmp_path / "accuracy-rel_pos" / "exp" / "eval" / "metrics.json").is_file()
    assert "rel_pos" in (tmp_path / "accuracy-rel_pos" / "params.yaml").read_text()
