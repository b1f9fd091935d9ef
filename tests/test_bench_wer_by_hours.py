"""bench.wer_by_hours: train splits of given hours drawn from one run folder, everything else of it shared."""

from __future__ import annotations

import json

import pytest
from lhotse import CutSet
from lhotse.testing.dummies import dummy_cut

from bench.wer_by_hours import TRAIN_CUTS, draw_hours, epochs_reached, main, plot


@pytest.fixture
def fbank(tmp_path):
    """A fbank folder of 100 train cuts of 30-129 s (2.21 h in all) and a test split."""
    folder = tmp_path / "fbank"
    folder.mkdir()
    cuts = [dummy_cut(i, duration=30.0 + i, recording_duration=30.0 + i) for i in range(100)]
    CutSet.from_cuts(cuts).to_file(folder / TRAIN_CUTS)
    CutSet.from_cuts([dummy_cut(1000)]).to_file(folder / "test_cuts.jsonl.gz")
    (folder / "cmvn.json").write_text("{}")
    return folder


def test_a_draw_is_whole_train_utterances_of_the_hours_asked_the_rest_linked(fbank, tmp_path):
    drawn = draw_hours(fbank, 1.0, tmp_path / "one" / "fbank", seed=0)
    cuts = CutSet.from_file(tmp_path / "one" / "fbank" / TRAIN_CUTS)
    seconds = sum(cut.duration for cut in cuts)
    assert seconds >= 3600 and seconds - max(cut.duration for cut in cuts) < 3600  # stops once the hours are in
    assert drawn == {"hours_drawn": pytest.approx(seconds / 3600), "utterances": len(cuts)}
    train_ids = {cut.id for cut in CutSet.from_file(fbank / TRAIN_CUTS)}
    assert {cut.id for cut in cuts} < train_ids
    for name in ("test_cuts.jsonl.gz", "cmvn.json"):
        assert (tmp_path / "one" / "fbank" / name).resolve() == (fbank / name).resolve()
    again = draw_hours(fbank, 1.0, tmp_path / "again" / "fbank", seed=0)
    other = draw_hours(fbank, 1.0, tmp_path / "other" / "fbank", seed=1)
    assert again == drawn
    assert {cut.id for cut in CutSet.from_file(tmp_path / "other" / "fbank" / TRAIN_CUTS)} != {cut.id for cut in cuts}
    assert other["hours_drawn"] >= 1.0


def test_more_hours_than_the_train_split_holds_are_refused(fbank, tmp_path):
    with pytest.raises(ValueError, match=r"holds 2\.21 h of train audio, fewer than the 3\.0 h asked"):
        draw_hours(fbank, 3.0, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_epochs_come_from_the_steps_an_epoch_takes(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("... INFO [asrflow.progress] step 1/5000 (0%) epoch 0: loss 8.5970, 71.6 audio s/s, ETA 16m06s\n")
    assert epochs_reached(log, 183) == pytest.approx(36.6)  # 5 steps an epoch over the bench's 1,000 epochs
    log.write_text("no progress line\n")
    assert epochs_reached(log, 183) is None


def test_the_plot_is_a_png_of_each_size(tmp_path):
    sizes = [
        {"hours_drawn": h, "wer": w, "cer": c, "epochs": e}
        for h, w, c, e in [(5, 0.86, 0.26, 9.6), (15, 0.83, 0.24, None)]
    ]
    plot(sizes, tmp_path / "by_hours.png", "test")
    assert (tmp_path / "by_hours.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sizes_run_apart_are_drawn_from_their_records_in_order_of_hours(tmp_path):
    records = {5: tmp_path / "five.jsonl", 15: tmp_path / "fifteen.jsonl"}
    for hours, path in records.items():
        size = {"benchmark": "wer_by_hours", "hours": hours, "hours_drawn": hours, "minutes": 30, "wer": 0.8}
        path.write_text(json.dumps({"benchmark": "machine"}) + "\n" + json.dumps(size | {"cer": 0.2}) + "\n")
    drawn = main(["--plot", str(tmp_path / "both.png"), "--plot-records", str(records[15]), str(records[5])])
    assert [size["hours"] for size in drawn] == [5, 15]
    assert (tmp_path / "both.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
