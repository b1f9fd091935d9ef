"""bench.accuracy_at_time: each variant trained for its minutes by the train stage, then scored on the test split."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.accuracy_at_time import main, variant


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
    assert found["steps"] > 0 and found["last_train_loss"] > 0
    assert 0 <= found["cer"] <= 1 and 0 <= found["wer"] <= 1.5
    assert (tmp_path / "accuracy-rel_pos" / "exp" / "eval" / "metrics.json").is_file()
    assert "rel_pos" in (tmp_path / "accuracy-rel_pos" / "params.yaml").read_text()
