"""SentencePiece tokenizer with a fixed CTC blank.

Id layout of every asrflow tokenizer: ``0 = <blk>`` (the CTC blank, never produced by
SentencePiece for text), ``1 = <unk>``, then the pieces. There is no BOS/EOS/PAD.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm

from asrflow.errors import AsrflowError
from asrflow.params import check_at_least, check_choice, param_error

BLANK_ID = 0
BLANK = "<blk>"
UNK_ID = 1
MODEL_FILE = "tokenizer.model"
TOKENS_FILE = "tokens.txt"
#: Accepted values of ``tokenizer.model_type``.
MODEL_TYPES = ("char", "bpe", "unigram", "word")
#: Pieces every model holds besides the characters: ``<blk>``, ``<unk>`` and ``▁``.
SPECIAL_PIECES = 3
#: The smallest vocabulary: the special pieces (a smaller one cannot spell any text).
MIN_VOCAB_SIZE = SPECIAL_PIECES


@dataclass(frozen=True)
class TokenizerConfig:
    """The ``tokenizer:`` section of params.yaml (each key is documented there, the only place its default
    lives)."""

    model_type: str
    vocab_size: int
    character_coverage: float

    def __post_init__(self) -> None:
        check_choice(self, "tokenizer", "model_type", MODEL_TYPES)
        check_at_least(self, "tokenizer", MIN_VOCAB_SIZE, "vocab_size")
        if not 0.0 < self.character_coverage <= 1.0:
            raise param_error("tokenizer", "character_coverage", self.character_coverage, "must be in (0, 1]")


def train_tokenizer(texts: Iterable[str], output_dir: str | Path, config: TokenizerConfig) -> Path:
    """Train SentencePiece on ``texts`` (the train split only) into ``output_dir``.

    Writes ``tokenizer.model`` and ``tokens.txt`` (``piece id`` per line). For the char
    model the vocabulary is what the text holds, so ``vocab_size`` is only an upper bound,
    but it must leave room for every character (see :func:`_check_characters_covered`).
    Every sentence is kept, repeats included (their counts are BPE/unigram statistics),
    and sorted, so training is deterministic for the same text and params whatever the
    input order (single thread). Returns the model path.

    Raises:
        AsrflowError: no text, a vocabulary too large or too small for the text.
    """
    lines = sorted(line.strip() for line in texts if line.strip())
    if not lines:
        raise AsrflowError("the train split has no text to train the tokenizer on")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    options = dict(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        character_coverage=config.character_coverage,
        user_defined_symbols=[BLANK],
        unk_id=UNK_ID,
        bos_id=-1,
        eos_id=-1,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    if config.model_type == "char":
        options["hard_vocab_limit"] = False
    try:
        spm.SentencePieceTrainer.train(**options)
    except RuntimeError as error:
        raise AsrflowError(_explain_training_error(str(error), config)) from None
    tokenizer = Tokenizer(model.getvalue())
    _check_characters_covered(tokenizer, lines, config)
    model_path = output_dir / MODEL_FILE
    model_path.write_bytes(model.getvalue())
    (output_dir / TOKENS_FILE).write_text("".join(f"{piece} {index}\n" for index, piece in enumerate(tokenizer.pieces)))
    return model_path


def _check_characters_covered(tokenizer: Tokenizer, lines: list[str], config: TokenizerConfig) -> None:
    """Fail when a character of the train text would be read as ``<unk>``.

    Applies to the subword models (char, bpe, unigram) with ``character_coverage: 1.0``,
    which must spell every character; a lower coverage maps rare characters to ``<unk>``
    on purpose, and a word model maps unseen words to it by design. A char model needs
    one piece per character plus ``<blk>``, ``<unk>`` and the word boundary ``▁``.
    """
    if config.model_type == "word" or config.character_coverage < 1.0:
        return
    characters = sorted({char for line in lines for char in line if not char.isspace()})
    lost = [char for char in characters if UNK_ID in tokenizer.encode(char)]
    if lost:
        needed = len(characters) + SPECIAL_PIECES
        raise AsrflowError(
            f"params.yaml: tokenizer.vocab_size = {config.vocab_size} leaves {len(lost)} of the "
            f"{len(characters)} characters of the train text unknown ({''.join(lost[:20])}); "
            f"set it to at least {needed}"
        )


def _explain_training_error(message: str, config: TokenizerConfig) -> str:
    match = re.search(r"Vocabulary size too high \((\d+)\).*<= (\d+)", message)
    if match:
        return (
            f"params.yaml: tokenizer.vocab_size = {config.vocab_size} is too large for the train text; "
            f"set it to at most {match.group(2)}"
        )
    match = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", message)
    if match:
        return (
            f"params.yaml: tokenizer.vocab_size = {config.vocab_size} is smaller than the "
            f"{match.group(2)} characters the text needs; set it to at least {int(match.group(2)) + 2}"
        )
    return f"SentencePiece could not train with params.yaml tokenizer settings: {message}"


class Tokenizer:
    """Text <-> token ids with the CTC blank at :data:`BLANK_ID`."""

    def __init__(self, model: str | Path | bytes):
        self.processor = spm.SentencePieceProcessor()
        if isinstance(model, bytes):
            self.processor.LoadFromSerializedProto(model)
        else:
            self.processor.Load(str(model))
        if self.processor.PieceToId(BLANK) != BLANK_ID:
            raise AsrflowError(f"tokenizer {model!r} has no {BLANK} at id {BLANK_ID}: retrain it")

    @property
    def vocab_size(self) -> int:
        """Number of output classes, blank included."""
        return self.processor.GetPieceSize()

    @property
    def pieces(self) -> list[str]:
        """Every piece by id; ``pieces[0]`` is the blank."""
        return [self.processor.IdToPiece(index) for index in range(self.vocab_size)]

    def serialized(self) -> bytes:
        """The model as bytes, for self-contained bundles."""
        return self.processor.serialized_model_proto()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (never the blank)."""
        return self.processor.EncodeAsIds(text)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode` of each of ``texts``, in one call (SentencePiece's batch encoding)."""
        return self.processor.Encode(texts, num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; blanks are dropped."""
        return self.processor.DecodeIds([int(i) for i in ids if int(i) != BLANK_ID])

    def __getstate__(self) -> dict:
        return {"model": self.serialized()}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model"])
