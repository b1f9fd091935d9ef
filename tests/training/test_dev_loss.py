"""Dev loss: the stall watchdog's heartbeat is called per dev batch, so a long dev pass is not a hang.

The real model, dataset and cuts of the prepared yesno data (the trainer passes
``StallWatchdog.beat`` as the callback).
"""

from __future__ import annotations

import pytest
import torch

from asrflow.data.features.cmvn import CMVN_FILE, load_cmvn
from asrflow.data.loading.dataset import AsrBatchDataset
from asrflow.data.manifests import load_cuts
from asrflow.model.conformer_ctc import build_model
from asrflow.tokenizer import MODEL_FILE, Tokenizer
from asrflow.training.distributed import DistInfo
from asrflow.training.precision import resolve_precision
from asrflow.training.validation import dev_batches, dev_loss
from tests.support.tiny_config import tiny_settings


@pytest.fixture(scope="module")
def dev_setup(yesno_data):
    tokenizer = Tokenizer(yesno_data / "lang" / MODEL_FILE)
    cuts = load_cuts(yesno_data / "fbank", "train").to_eager()  # 27 utterances: many small dev batches
    dataset = AsrBatchDataset(cuts, tokenizer, load_cmvn(yesno_data / "fbank" / CMVN_FILE), seed=42)
    torch.manual_seed(0)
    model = build_model(tiny_settings().train.model, input_dim=80, vocab_size=tokenizer.vocab_size)
    return model, dataset, dev_batches(cuts, max_duration_s=12.0)


def test_dev_loss_beats_once_per_dev_batch_and_computes_the_same_loss(dev_setup):
    model, dataset, batches = dev_setup
    assert len(batches) >= 3
    precision = resolve_precision("fp32", "cpu", None)
    beats = []
    with_beat = dev_loss(
        model,
        dataset,
        batches,
        precision=precision,
        dist=DistInfo(),
        device=torch.device("cpu"),
        beat=lambda: beats.append(1),
    )
    assert len(beats) == len(batches)
    assert with_beat == dev_loss(
        model, dataset, batches, precision=precision, dist=DistInfo(), device=torch.device("cpu")
    )
