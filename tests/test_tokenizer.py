"""SentencePiece tokenizer: blank at 0, determinism, clear vocabulary-size errors."""

from __future__ import annotations

import pickle

import pytest

from asrflow.errors import AsrflowError
from asrflow.tokenizer import BLANK, BLANK_ID, UNK_ID, Tokenizer, train_tokenizer
from tests.support.corpora import tokenizer_config

TEXTS = ["YES NO YES NO", "NO NO YES YES", "YES YES YES NO"]


def test_char_model_reserves_blank_and_round_trips(tmp_path):
    tokenizer = Tokenizer(train_tokenizer(TEXTS, tmp_path, tokenizer_config()))
    assert tokenizer.pieces[BLANK_ID] == BLANK
    assert tokenizer.pieces[UNK_ID] == "<unk>"
    ids = tokenizer.encode("YES NO")
    assert BLANK_ID not in ids
    assert tokenizer.decode([BLANK_ID, *ids, BLANK_ID]) == "YES NO"
    assert (tmp_path / "tokens.txt").read_text().splitlines()[0] == f"{BLANK} 0"


def test_training_is_deterministic(tmp_path):
    first = train_tokenizer(TEXTS, tmp_path / "a", tokenizer_config(model_type="bpe", vocab_size=12))
    second = train_tokenizer(list(reversed(TEXTS)), tmp_path / "b", tokenizer_config(model_type="bpe", vocab_size=12))
    assert first.read_bytes() == second.read_bytes()


def test_too_large_vocabulary_names_a_size_that_works(tmp_path):
    with pytest.raises(AsrflowError, match=r"tokenizer.vocab_size = 500 .* at most (\d+)") as error:
        train_tokenizer(TEXTS, tmp_path, tokenizer_config(model_type="bpe", vocab_size=500))
    suggested = int(str(error.value).rsplit(" ", 1)[-1])
    Tokenizer(train_tokenizer(TEXTS, tmp_path, tokenizer_config(model_type="bpe", vocab_size=suggested)))


def test_unknown_model_type_and_empty_text_are_user_errors(tmp_path):
    with pytest.raises(AsrflowError, match="model_type"):
        train_tokenizer(TEXTS, tmp_path, tokenizer_config(model_type="wordpiece"))
    with pytest.raises(AsrflowError, match="no text"):
        train_tokenizer(["", "  "], tmp_path, tokenizer_config())


def test_tokenizer_pickles_for_data_workers(tmp_path):
    tokenizer = Tokenizer(train_tokenizer(TEXTS, tmp_path, tokenizer_config()))
    clone = pickle.loads(pickle.dumps(tokenizer))
    assert clone.encode("NO YES") == tokenizer.encode("NO YES")


def test_char_vocabulary_too_small_for_the_characters_names_a_size_that_works(tmp_path):
    # yesno has 5 characters (Y, E, S, N, O): a char model of 5 pieces would read 3 as <unk>
    with pytest.raises(AsrflowError, match=r"tokenizer.vocab_size = 5 leaves 3 of the 5 characters .* at least 8$"):
        train_tokenizer(TEXTS, tmp_path / "small", tokenizer_config(model_type="char", vocab_size=5))
    assert not (tmp_path / "small" / "tokenizer.model").exists()
    tokenizer = Tokenizer(train_tokenizer(TEXTS, tmp_path / "ok", tokenizer_config(model_type="char", vocab_size=8)))
    assert UNK_ID not in tokenizer.encode(" ".join(TEXTS))


@pytest.mark.parametrize("size", [0, 2, -1])
def test_vocabulary_size_below_the_special_pieces_is_a_param_error(tmp_path, size):
    with pytest.raises(AsrflowError, match=rf"tokenizer.vocab_size = {size} must be at least 3"):
        tokenizer_config(vocab_size=size)


def test_character_coverage_out_of_range_is_a_param_error():
    with pytest.raises(AsrflowError, match=r"tokenizer.character_coverage = 0 must be in \(0, 1\]"):
        tokenizer_config(character_coverage=0)


def test_repeated_sentences_count_in_the_statistics(tmp_path):
    config = tokenizer_config(model_type="unigram", vocab_size=9)
    once = train_tokenizer(["YES NO", "NO YES", "YES YES"], tmp_path / "once", config)
    repeated = train_tokenizer(["YES NO", "NO YES", "YES YES"] + ["NO YES"] * 5, tmp_path / "repeated", config)
    assert once.read_bytes() != repeated.read_bytes()
