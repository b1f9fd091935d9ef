"""Fine-tuning pays: a model pre-trained on a spoken corpus synthesized with espeak-ng, fine-tuned on yesno with
its encoder frozen for the first steps, reaches yesno's dev WER goal (``MAX_DEV_WER`` of
:mod:`tests.support.trained_model`) in fewer steps than the same training from drawn weights.

Every run uses yesno's features (params.yaml), the tiny model, seed 42 and the schedule of
:mod:`tests.support.trained_model`; the spoken corpus has its own (char) tokenizer, so the fine-tuned run
draws its CTC head. The step a yesno run first reaches the goal is read from its checkpoints (one per epoch).
It synthesizes a corpus and trains three models (about two minutes on one core), so it is marked ``pipeline``
with the suite's other slow runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asrflow.data.features.cmvn import CMVN_FILE, cmvn_stats, load_cmvn
from asrflow.generate import spoken_corpus
from asrflow.model.conformer_ctc import build_from_record
from asrflow.serving.bundle import load_bundle, save_bundle
from asrflow.training.checkpoint import list_checkpoints, load_checkpoint, step_of
from tests.support.corpora import folder_corpus, prepare_from_params, torch_threads, yesno_data
from tests.support.repo import repo_params
from tests.support.tiny_config import tiny_trainer
from tests.support.trained_model import MAX_DEV_WER, TRAIN_OVERRIDES, dev_wer

MISSING = spoken_corpus.espeak_missing()
pytestmark = [
    pytest.mark.pipeline,
    pytest.mark.skipif(MISSING is not None, reason=f"{MISSING}; the pre-training corpus is synthesized with it"),
]

#: Checkpoints every 3 steps (one yesno epoch): the resolution of the step counts compared.
EVERY = 3
#: The pre-training corpus: about an hour of 2-8 word sentences from 60 voices (seconds to synthesize).
SPOKEN = {"utterances": 1200, "voices": 60, "word_range": (2, 8), "seed": 0}
#: The fine-tuning run trains only the drawn head on the loaded encoder's output at first.
FINETUNE = {"train.finetune.freeze_encoder_steps": 30}


def train(data: Path, exp: Path, overrides: dict | None = None) -> Path:
    """The tiny run of :mod:`tests.support.trained_model` on ``data`` (its own features) with ``overrides``
    (dotted keys), checkpointed every :data:`EVERY` steps."""
    schedule = {"train.checkpoint.checkpoint_every_steps": EVERY, "train.checkpoint.keep_last": 1000}
    overrides = {**TRAIN_OVERRIDES, **schedule, **(overrides or {})}
    tiny_trainer(data, exp, overrides, seed=42, tracking_uri=f"sqlite:///{exp / 'mlflow.db'}").run()
    return exp


def steps_to_goal(data: Path, exp: Path) -> int | None:
    """The first checkpointed step whose weights reach :data:`MAX_DEV_WER` on ``data``'s dev split."""
    final = load_bundle(exp / "model.pt")
    cmvn = cmvn_stats(load_cmvn(data / "fbank" / CMVN_FILE))
    for path in sorted(list_checkpoints(exp / "checkpoints"), key=step_of):
        model = build_from_record(final.model.shape)
        model.load_state_dict(load_checkpoint(path)["model"])
        weights = exp / "at_step.pt"
        save_bundle(
            weights,
            model_state=model.state_dict(),
            model_shape=final.model.shape,
            tokenizer=final.tokenizer,
            features=final.features,
            cmvn=cmvn,
            run_id=None,
        )
        if dev_wer(weights, data / "fbank") <= MAX_DEV_WER:
            return step_of(path)
    return None


def spoken_data(work: Path) -> Path:
    """The spoken corpus prepared with yesno's features (params.yaml) and a char tokenizer of its own."""
    corpus = work / "spoken-corpus"
    spoken_corpus.generate(corpus, **SPOKEN)
    params = {**repo_params(), "tokenizer": {"model_type": "char", "vocab_size": 40, "character_coverage": 1.0}}
    with torch_threads(1):
        return prepare_from_params(work / "spoken", folder_corpus(corpus), params, num_jobs=1)


def test_a_finetuned_model_reaches_the_goal_in_fewer_steps(tmp_path_factory):
    work = tmp_path_factory.mktemp("finetune_gain")
    base = train(spoken_data(work), work / "base", {"train.optim.epochs": 15, "train.data.max_duration_s": 120.0})
    yesno = yesno_data(work)
    scratch = steps_to_goal(yesno, train(yesno, work / "scratch"))
    tuned_overrides = {"train.finetune.init_from": str(base / "model.pt"), **FINETUNE}
    tuned = steps_to_goal(yesno, train(yesno, work / "tuned", tuned_overrides))
    print(json.dumps({"steps_to_goal": {"from_scratch": scratch, "fine_tuned": tuned}}))
    assert tuned is not None, "the fine-tuned run never reached the goal"
    assert scratch is None or tuned < scratch, (tuned, scratch)
