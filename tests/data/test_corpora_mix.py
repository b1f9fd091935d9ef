"""Several corpora in one run (``prepare.corpora``, ``train.data.corpus_weights``): two generated folder
corpora through prepare, features and tokenizer; their test sets named per corpus; epoch plans that take
each corpus in proportion to its weight, the same for a seed and after a restart; a few real training
steps and an evaluation that scores each corpus' test set on its own."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from asrflow.data.loading.cut_index import CutIndex
from asrflow.data.loading.planner import CorpusMix, TrainingBatches, mix_positions, plan_epoch
from asrflow.data.manifests import cuts_path, list_corpora, list_test_sets, load_cuts
from asrflow.data.prepare.config import PrepareConfig
from asrflow.errors import AsrflowError
from asrflow.training.train_data import TrainData, corpus_mix
from tests.support.corpora import (
    feature_config,
    generate_corpus,
    prepare_features_tokenizer,
    tokenizer_config,
    torch_threads,
)
from tests.support.tiny_config import tiny_settings, tiny_train_data

SEED = 42
#: Utterances generated per corpus (train, dev and test TSVs of :func:`generate_corpus`).
SIZES = {"published": 12, "scraped": 24}


def two_corpora_config(root: Path) -> PrepareConfig:
    """``published`` keeps its own dev and test; ``scraped`` has both carved from its train (and its
    name sorts after the other's: its carved dev cuts come first yet must be sorted in among them)."""
    return PrepareConfig.from_section(
        {
            "corpus_dir": str(root / "corpora"),
            "corpora": [
                {
                    "name": "published",
                    "corpus": "folder",
                    "corpus_dir": str(root / "corpora" / "published"),
                    "splits": {"train": "train", "dev": "dev", "test": "test"},
                },
                {
                    "name": "scraped",
                    "corpus": "folder",
                    "corpus_dir": str(root / "corpora" / "scraped"),
                    "splits": {"train": "train", "dev": None, "test": None},
                    "dev_fraction": 0.15,
                    "test_fraction": 0.15,
                },
            ],
        }
    )


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("two-corpora")
    for seed, (name, size) in enumerate(SIZES.items()):
        generate_corpus(root / "corpora" / name, size, seed=seed, min_s=1.0, max_s=3.0, dev_fraction=0.2)
    with torch_threads(1):
        prepare_features_tokenizer(
            root, two_corpora_config(root), feature_config(num_jobs=1), tokenizer_config(), seed=SEED
        )
    return root


def corpus_counts(ids) -> Counter:
    return Counter(cut_id.split("/", 1)[0] for cut_id in ids)


def test_each_corpus_keeps_its_test_set_and_every_id_names_its_corpus(two_corpora):
    for folder in ("manifests", "fbank"):
        assert list_corpora(two_corpora / folder) == ["published", "scraped"]
        assert list_test_sets(two_corpora / folder) == ["published/test", "scraped/test"]
    manifests = two_corpora / "manifests"
    for split in ("train", "dev", "published/test", "scraped/test"):
        ids = [cut.id for cut in load_cuts(manifests, split)]
        assert ids == sorted(ids), split
    train = [cut.id for cut in load_cuts(manifests, "train")]
    assert set(corpus_counts(train)) == {"published", "scraped"}
    assert set(corpus_counts(cut.id for cut in load_cuts(manifests, "dev"))) == {"published", "scraped"}
    for name in SIZES:
        test = list(load_cuts(manifests, f"{name}/test"))
        assert test and all(cut.id.startswith(f"{name}/") and cut.recording.id.startswith(f"{name}/") for cut in test)
    summary = json.loads((manifests / "summary.json").read_text())
    assert (
        summary["splits"]["scraped/test"]["carved_from_train"]
        and not summary["splits"]["published/test"]["carved_from_train"]
    )
    # every utterance read once: the generated corpora's ids repeat (utt00000 ...), their prefixed ids do not
    read = [two_corpora / "corpora" / "published" / f"{split}.tsv" for split in ("train", "dev", "test")]
    read.append(two_corpora / "corpora" / "scraped" / "train.tsv")
    assert summary["items_total"] == sum(len(path.read_text().splitlines()) for path in read)
    assert sum(split["utterances"] for split in summary["splits"].values()) == summary["items_total"]


#: The runs' batching: short batches in two buckets (the corpora are small).
BATCHING = {"train.data.max_duration_s": 8.0, "train.data.num_buckets": 2}


def _train_data(data: Path, **weights: float) -> TrainData:
    return tiny_train_data(data, {**BATCHING, "train.data.corpus_weights": weights}, seed=SEED)


def test_an_epoch_takes_each_corpus_in_proportion_to_its_weight(two_corpora):
    data = _train_data(two_corpora, published=2.0, scraped=0.5)
    held = corpus_counts(data.batches.cuts.id_list())
    plans = [data.batches.plan(epoch) for epoch in (0, 1)]
    for plan in plans:
        taken = [cut_id for batch in plan for cut_id in batch]
        assert corpus_counts(taken) == {"published": 2 * held["published"], "scraped": round(0.5 * held["scraped"])}
        published = Counter(cut_id for cut_id in taken if cut_id.startswith("published/"))
        assert set(published.values()) == {2}  # weight 2: every cut of published twice
        assert len({cut_id for cut_id in taken if cut_id.startswith("scraped/")}) == round(0.5 * held["scraped"])
    assert {c for b in plans[0] for c in b if c.startswith("scraped/")} != {
        c for b in plans[1] for c in b if c.startswith("scraped/")
    }
    again = _train_data(two_corpora, published=2.0, scraped=0.5)
    assert [again.batches.plan(epoch).digest for epoch in (0, 1)] == [plan.digest for plan in plans]
    other_seed = plan_epoch(
        data.batches.cuts, 0, seed=SEED + 1, max_duration_s=8.0, num_buckets=2, mix=data.batches.mix
    )
    assert other_seed.digest != plans[0].digest


def test_weights_of_one_plan_what_one_corpus_plans(two_corpora):
    index = _train_data(two_corpora).batches.cuts
    assert _train_data(two_corpora).batches.mix is None
    ones = corpus_mix(index, ["published", "scraped"], {"published": 1.0})
    assert ones is None
    mix = CorpusMix(corpus_of=np.repeat([0, 1], [3, len(index) - 3]), weights=(1.0, 1.0), names=("x", "y"))
    assert np.array_equal(mix_positions(mix, SEED, 0), np.arange(len(index)))
    plain = plan_epoch(index, 3, seed=SEED, max_duration_s=8.0, num_buckets=2)
    assert plan_epoch(index, 3, seed=SEED, max_duration_s=8.0, num_buckets=2, mix=mix) == plain


def test_a_restart_plans_the_same_batches_from_any_step(two_corpora):
    data = _train_data(two_corpora, published=3.0, scraped=0.7)
    options = {
        "seed": SEED,
        "max_duration_s": 8.0,
        "num_buckets": 2,
        "accum_grad": 1,
        "world_size": 1,
        "rank": 0,
        "num_epochs": 3,
        "mix": data.batches.mix,
    }
    whole = list(TrainingBatches(data.batches.cuts, start_epoch=0, start_step=0, **options))
    start = next(i for i, item in enumerate(whole) if item.epoch == 1) + 2
    restarted = TrainingBatches(data.batches.cuts, start_epoch=1, start_step=2, **options)
    assert list(restarted) == whole[start:]


def test_weights_must_name_corpora_that_were_prepared(two_corpora, yesno_data):
    index = CutIndex.build(cuts_path(two_corpora / "fbank", "train"), two_corpora / "lines.jsonl")
    with pytest.raises(AsrflowError, match="corpus_weights names tiny, but the corpora are published, scraped"):
        corpus_mix(index, ["published", "scraped"], {"tiny": 2.0})
    with pytest.raises(AsrflowError, match="corpus_weights names yesno, but there is one corpus, unnamed"):
        _train_data(yesno_data, yesno=2.0)


@pytest.mark.slow
def test_a_few_steps_train_on_both_and_evaluate_scores_each_test_set(two_corpora, tmp_path):
    from mlflow.tracking import MlflowClient

    from asrflow.evaluation.evaluate import EvaluateConfig, evaluate
    from tests.support.mlflow_store import fresh_mlflow_store
    from tests.support.tiny_config import tiny_trainer

    overrides = {**BATCHING, "train.data.corpus_weights": {"published": 2.0}, "train.optim.epochs": 1}
    uri = fresh_mlflow_store(tmp_path)
    with torch_threads(1):
        trainer = tiny_trainer(two_corpora, tmp_path, overrides, seed=SEED, tracking_uri=uri)
        trainer.run()
        metrics = evaluate(
            tmp_path / "model.pt", two_corpora / "fbank", tmp_path / "eval", EvaluateConfig(), tracking_uri=uri
        )
    assert list(metrics["test_sets"]) == ["published/test", "scraped/test"]
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name(trainer.run_config.experiment).experiment_id])
    assert {"test/published/test/wer", "test/scraped/test/wer"} <= set(run.data.metrics)


def test_an_interrupted_run_with_other_weights_is_refused(tmp_path):
    from asrflow.training.fingerprint import build_fingerprint
    from asrflow.training.resume import decide

    def fingerprint(**weights: float) -> dict:
        config = tiny_settings(overrides={"train.data.corpus_weights": weights}).train
        return build_fingerprint({}, {}, data_digest="d", seed=SEED, config=config)

    unfinished = {"fingerprint": fingerprint(published=2.0), "train_params": {}, "complete": False, "step": 7}
    assert decide(unfinished, fingerprint(published=2.0), {}, tmp_path) == "resume"
    with pytest.raises(AsrflowError, match=r"train.data.corpus_weights: \{'published': 2.0\} -> \{'published': 3.0\}"):
        decide(unfinished, fingerprint(published=3.0), {}, tmp_path)


@pytest.mark.slow
def test_sigkill_in_a_mixed_epoch_then_resume_is_bit_identical(two_corpora, tmp_path):
    """A real training process on the two corpora (weights 2 and 0.5, a data worker), killed in its second
    epoch and run again, ends with the same weights and the same loss at every step as an uninterrupted run."""
    import torch

    from asrflow.training.checkpoint import list_checkpoints, load_checkpoint
    from tests.support.train_entry import TrainingProcess, run_training

    overrides = {
        **BATCHING,
        "train.data.corpus_weights": {"published": 2.0, "scraped": 0.5},
        "train.optim.epochs": 2,
        "train.checkpoint.checkpoint_every_steps": 2,
        "train.checkpoint.validate_every_steps": 4,
        "run.num_workers": 1,
    }
    data = _train_data(two_corpora, published=2.0, scraped=0.5)
    steps, total = data.steps_per_epoch(0), data.steps_per_epoch(0) + data.steps_per_epoch(1)

    def final(exp: Path) -> tuple[dict, dict]:
        bundle = torch.load(exp / "model.pt", map_location="cpu", weights_only=True)
        return bundle["model"], load_checkpoint(list_checkpoints(exp / "checkpoints")[0])["history"]

    run_training(two_corpora, tmp_path / "reference", overrides, log_path=tmp_path / "reference.log")
    process = TrainingProcess(two_corpora, tmp_path / "killed", overrides, pause_after_step=steps + 3)
    process.wait_paused()
    process.kill()
    log = run_training(two_corpora, tmp_path / "killed", overrides, log_path=tmp_path / "resumed.log")
    assert f"step {steps + 2}" in log and "resuming from" in log
    (weights, history), (reference_weights, reference_history) = (
        final(tmp_path / "killed"),
        final(tmp_path / "reference"),
    )
    assert history["step"] == reference_history["step"] == list(range(1, total + 1))
    assert history["loss"] == reference_history["loss"]  # float for float
    for name, tensor in reference_weights.items():
        assert torch.equal(weights[name], tensor), name


def test_the_corpus_listing_lists_every_corpus_folder(tmp_path):
    """prepare's dependency: the listing of each entry's corpus_dir (the section's for an entry without one)."""
    from stages import corpus_listing
    from tests.support.repo import write_shipped_params

    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.tsv").write_text("")
    corpora = [{"name": "one"}, {"name": "two", "corpus_dir": str(tmp_path / "second")}]
    params = write_shipped_params(tmp_path, {"prepare.corpus_dir": str(tmp_path / "first"), "prepare.corpora": corpora})
    corpus_listing.main(["--params", str(params), "--out", str(tmp_path / "listing.tsv")])
    lines = (tmp_path / "listing.tsv").read_text().splitlines()
    assert [line.split("\t")[0] for line in lines] == [
        f"# {tmp_path / 'first'}",
        "first.tsv",
        f"# {tmp_path / 'second'}",
        "second.tsv",
    ]
