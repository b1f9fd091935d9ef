"""Transcript normalisation rules (asrflow.data.prepare.text)."""

from __future__ import annotations

import pytest

from asrflow.data.prepare.text import TextConfig, normalize_text
from asrflow.errors import AsrflowError


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("Hello, world!", "HELLO WORLD"),
        ("don't  stop", "DON'T STOP"),
        ("'quoted' words", "QUOTED WORDS"),
        ("James' book", "JAMES BOOK"),
        ("well-known", "WELL KNOWN"),
        ("it\u2019s fine", "IT'S FINE"),  # typographic apostrophe
        ("  tabs\tand\nnewlines  ", "TABS AND NEWLINES"),
        ("zero\u200bwidth\ufeff", "ZEROWIDTH"),  # format characters removed
        ("cafe\u0301", "CAFÉ"),  # NFC composes e + combining acute
        ("costs $5 (about)", "COSTS $5 ABOUT"),  # symbols are not punctuation
        ("...", ""),
    ],
)
def test_default_rules_upper_case_without_punctuation(raw: str, expected: str) -> None:
    assert normalize_text(raw, TextConfig()) == expected


def test_lower_and_keep_case() -> None:
    assert normalize_text("Hello World", TextConfig(case="lower")) == "hello world"
    assert normalize_text("Hello World", TextConfig(case="keep")) == "Hello World"


def test_punctuation_kept_when_not_stripped() -> None:
    config = TextConfig(strip_punctuation=False)
    assert normalize_text("Hello,  world!", config) == "HELLO, WORLD!"


def test_whitelist_removes_other_characters_but_keeps_word_breaks() -> None:
    config = TextConfig(whitelist="ABCDEFGHIJKLMNOPQRSTUVWXYZ'")  # no space listed
    assert normalize_text("Café au lait, 2 don't", config) == "CAF AU LAIT DON'T"


def test_bad_case_and_empty_whitelist_are_user_errors() -> None:
    with pytest.raises(AsrflowError, match="prepare.text.case"):
        TextConfig(case="title")
    with pytest.raises(AsrflowError, match="whitelist"):
        TextConfig(whitelist="  ")
