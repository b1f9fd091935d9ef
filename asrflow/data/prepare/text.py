"""Transcript normalisation for the ``prepare`` stage (params: ``prepare.text``).

Every transcript goes through these steps, in this order:

1. **Unicode NFC.** Composed and decomposed spellings of one character become the same
   code points (``"e" + U+0301`` -> ``"é"``).
2. **Apostrophes.** Typographic apostrophes and single quotes (U+2018, U+2019, U+02BC,
   U+2032, U+0060) become the ASCII apostrophe ``'``.
3. **Invisible characters.** Control and format characters (Unicode categories Cc and
   Cf, e.g. a byte-order mark or a zero-width space) are removed; tabs and line breaks
   count as whitespace.
4. **Case** (``case``): ``upper`` or ``lower`` converts with Python's Unicode case
   mapping; ``keep`` leaves it.
5. **Punctuation** (``strip_punctuation: true``): every character of a Unicode
   punctuation category (P*) becomes a space, except an apostrophe with a letter or
   digit on both sides, which is kept (``don't`` stays, ``'quoted'`` -> ``quoted``,
   ``well-known`` -> ``well known``). Symbols (``$``, ``%``, ``+``) are not punctuation
   and stay unless the whitelist removes them.
6. **Whitelist** (``whitelist``, optional): any character that is not in the string and
   is not whitespace is removed (not replaced by a space). Whitespace always separates
   words, whether the whitelist lists the space or not. The whitelist is applied after the
   case step, so list the characters in the case you asked for.
7. **Whitespace.** Runs of whitespace become one space; leading and trailing whitespace
   goes.

A transcript that is empty after these steps is rejected by the validation
(``empty_transcript``).
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

from asrflow.errors import AsrflowError

#: Accepted values of ``prepare.text.case``.
CASES = ("upper", "lower", "keep")

_APOSTROPHES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u02bc": "'", "\u2032": "'", "`": "'"})


@dataclass(frozen=True)
class TextConfig:
    """The ``prepare.text`` section of ``params.yaml``.

    Attributes:
        case: ``upper``, ``lower`` or ``keep``.
        strip_punctuation: replace punctuation by spaces (apostrophes inside words stay).
        whitelist: if set, the only non-whitespace characters kept.
    """

    case: str = "upper"
    strip_punctuation: bool = True
    whitelist: str | None = None

    def __post_init__(self) -> None:
        if self.case not in CASES:
            raise AsrflowError(
                f"params.yaml: prepare.text.case = {self.case!r} is not valid; use one of {', '.join(CASES)}"
            )
        if self.whitelist is not None and not self.whitelist.strip():
            raise AsrflowError(
                "params.yaml: prepare.text.whitelist is empty; give the characters to keep, or null for all"
            )


def _is_word_char(char: str) -> bool:
    return char.isalnum()


def _strip_punctuation(text: str) -> str:
    out = []
    last = len(text) - 1
    for index, char in enumerate(text):
        if not unicodedata.category(char).startswith("P") or (
            char == "'" and 0 < index < last and _is_word_char(text[index - 1]) and _is_word_char(text[index + 1])
        ):
            out.append(char)
        else:
            out.append(" ")
    return "".join(out)


def normalize_text(text: str, config: TextConfig) -> str:
    """Normalise one transcript by the rules of this module's docstring.

    Args:
        text: the raw transcript.
        config: the ``prepare.text`` settings.

    Returns:
        The normalised transcript; an empty string when nothing is left.
    """
    text = unicodedata.normalize("NFC", text).translate(_APOSTROPHES)
    text = "".join(
        " " if char.isspace() else char
        for char in text
        if char.isspace() or unicodedata.category(char) not in ("Cc", "Cf")
    )
    if config.case == "upper":
        text = text.upper()
    elif config.case == "lower":
        text = text.lower()
    if config.strip_punctuation:
        text = _strip_punctuation(text)
    if config.whitelist is not None:
        allowed = set(config.whitelist)
        text = "".join(char for char in text if char in allowed or char.isspace())
    return " ".join(text.split())
