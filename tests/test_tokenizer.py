"""SentencePiece tokenizer: blank at 0, determinism, clear vocabulary-size errors."""

from __future__ import annotations

import pickle

import pytest

from asrflow.errors import AsrflowError
from asrflow.tokenizer import BLANK, BLANK_ID, UNK_ID, Tokenizer, TokenizerConfig, train_tokenizer

TEXTS = ["YES NO YES NO", "NO NO YES YES", "YES YES YES NO"]


def test_char_model_reserves_blank_and_round_trips(tmp_path):
    tokenizer = Tokenizer(train_tokenizer(TEXTS, tmp_path, TokenizerConfig()))
    assert tokenizer.pieces[BLANK_ID] == BLANK
    assert tokenizer.pieces[UNK_ID] == "<unk>"
    ids = tokenizer.encode("YES NO")
    assert BLANK_ID not in ids
    assert tokenizer.decode([BLANK_ID, *ids, BLANK_ID]) == "YES NO"
    assert (tmp_path / "tokens.txt").read_text().splitlines()[0] == f"{BLANK} 0"


def test_training_is_deterministic(tmp_path):
    first = train_tokenizer(TEXTS, tmp_path / "a", TokenizerConfig(model_type="bpe", vocab_size=12))
    second = train_tokenizer(list(reversed(TEXTS)), tmp_path / "b", TokenizerConfig(model_type="bpe", vocab_size=12))
    assert first.read_bytes() == second.read_bytes()


def test_too_large_vocabulary_names_a_size_that_works(tmp_path):
    with pytest.raises(AsrflowError, match=r"tokenizer.vocab_size = 500 .* at most (\d+)") as error:
        train_tokenizer(TEXTS, tmp_path, TokenizerConfig(model_type="bpe", vocab_size=500))
    suggested = int(str(error.value).rsplit(" ", 1)[-1])
    Tokenizer(train_tokenizer(TEXTS, tmp_path, TokenizerConfig(model_type="bpe", vocab_size=suggested)))


def test_unknown_model_type_and_empty_text_are_user_errors(tmp_path):
    with pytest.raises(AsrflowError, match="model_type"):
        train_tokenizer(TEXTS, tmp_path, TokenizerConfig(model_type="wordpiece"))
    with pytest.raises(AsrflowError, match="no text"):
        train_tokenizer(["", "  "], tmp_path, TokenizerConfig())


def test_tokenizer_pickles_for_data_workers(tmp_path):
    tokenizer = Tokenizer(train_tokenizer(TEXTS, tmp_path, TokenizerConfig()))
    clone = pickle.loads(pickle.dumps(tokenizer))
    assert clone.encode("NO YES") == tokenizer.encode("NO YES")
