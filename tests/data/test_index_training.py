"""A CutIndex serves training exactly as the in-memory CutSet does: same CTC filter, same
plans, bit-identical batches through a real DataLoader with spawned workers (issue 13, item 5)."""

from __future__ import annotations

import pytest
import torch

from asrflow.data.features.cmvn import CMVN_FILE, load_cmvn
from asrflow.data.loading.config import DataConfig
from asrflow.data.loading.ctc_filter import filter_ctc_feasible, filter_ctc_feasible_index
from asrflow.data.loading.cut_index import CutIndex
from asrflow.data.loading.dataset import AsrBatchDataset
from asrflow.data.loading.planner import TrainingBatches
from asrflow.data.loading.workers import pack_batch, unpack_batch
from asrflow.data.manifests import cuts_path, load_cuts
from asrflow.tokenizer import MODEL_FILE, Tokenizer
from tests.support.repo import repo_config


def augment_config(**changes) -> DataConfig:
    """params.yaml's ``train.data`` section (the augmentation settings users get), with ``changes``."""
    return repo_config(DataConfig, "train.data", **changes)


SEED = 42


@pytest.mark.slow
def test_index_filters_plans_and_batches_like_the_cutset(yesno_data, tmp_path):
    tokenizer = Tokenizer(yesno_data / "lang" / MODEL_FILE)
    mvn = load_cmvn(yesno_data / "fbank" / CMVN_FILE)
    eager, removed_eager = filter_ctc_feasible(
        load_cuts(yesno_data / "fbank", "train").to_eager(), tokenizer, 0.01, 1.1
    )
    index, removed_index = filter_ctc_feasible_index(
        CutIndex.build(cuts_path(yesno_data / "fbank", "train"), tmp_path / "train.jsonl"), tokenizer, 0.01, 1.1
    )
    assert removed_index == sorted(removed_eager) and len(index) == len(eager)

    def served(cuts, workers: int) -> list[dict]:
        batches = TrainingBatches(
            cuts,
            seed=SEED,
            max_duration_s=20.0,
            num_buckets=4,
            accum_grad=2,
            world_size=1,
            rank=0,
            start_epoch=0,
            start_step=0,
            num_epochs=1,
        )
        dataset = AsrBatchDataset(cuts, tokenizer, mvn, seed=SEED, augment=augment_config())
        loader = torch.utils.data.DataLoader(
            dataset,
            sampler=batches,
            batch_size=None,
            collate_fn=pack_batch,
            num_workers=workers,
            multiprocessing_context="spawn" if workers else None,
        )
        return [unpack_batch(batch) for batch in loader]

    from_cutset, from_index = served(eager, 0), served(index, 1)
    assert len(from_cutset) == len(from_index) >= 4
    for a, b in zip(from_cutset, from_index, strict=True):
        assert a["item"] == b["item"]
        for key in ("features", "feature_lens", "targets", "target_lens"):
            assert torch.equal(a[key], b[key]), key
        assert a["step_tokens"] == b["step_tokens"]
        assert (a["step_tokens"] > 0) == (a["item"].micro_index == 0)


def test_ctc_verdicts_are_kept_in_the_shared_store(yesno_data, tmp_path, monkeypatch):
    """The CTC filter's pass over every transcript is done once per store and tokenizer: a later
    start on the same store keeps the same cuts without tokenizing them again; another key recomputes."""
    from asrflow.data.loading.index_store import shared_index

    tokenizer = Tokenizer(yesno_data / "lang" / MODEL_FILE)
    manifest = cuts_path(yesno_data / "fbank", "train")
    first, removed = filter_ctc_feasible_index(shared_index(manifest, tmp_path), tokenizer, 0.01, 1.1, cache_key="a")

    def no_tokenizing(_texts):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(tokenizer, "encode_many", no_tokenizing)
    again, removed_again = filter_ctc_feasible_index(
        shared_index(manifest, tmp_path), tokenizer, 0.01, 1.1, cache_key="a"
    )
    assert again.id_list() == first.id_list() and removed_again == removed and again.digest == first.digest
    with pytest.raises(AssertionError, match="tokenized again"):
        filter_ctc_feasible_index(shared_index(manifest, tmp_path), tokenizer, 0.01, 1.1, cache_key="b")
