"""Real English sentences for the spoken corpus, read from Debian's ``fortunes`` package.

The source is the fortune cookie files that ``apt-get install fortunes fortunes-min`` puts in
:data:`FORTUNES_DIR` (quotations, jokes, definitions, poems; see ``sentences.NOTICE`` beside this module
for what they are and their licence). Nothing is downloaded and nothing is copied into the repository: the
files are read where the package installed them. Only the files directly in that folder are read: Debian
ships the offensive fortunes separately (package ``fortunes-off``, in its ``off/`` subfolder), and they are
never used; :data:`SKIPPED_FILES` (ASCII drawings, text in other languages) are left out too.

Each fortune (the text between two ``%`` lines) loses its attribution lines (``-- Mark Twain``), is joined
into one line and split into sentences after ``.``, ``!`` or ``?``. A sentence is usable when espeak-ng
reads every character of it plainly: only letters, spaces, apostrophes and the punctuation of
:data:`_PLAIN` (no digits, which espeak-ng speaks as words the transcript would not hold; no symbols,
URLs or code), no all-capital word of two letters or more (espeak-ng spells acronyms letter by letter), and
no one-letter word but "a" and "I" (a fragment of an abbreviation). It is then normalised the way the
pipeline's ``prepare.text`` keeps text (:mod:`asrflow.data.prepare.text`, lowercase here like the word
corpus): punctuation becomes spaces, apostrophes stay inside words only, runs of spaces become one. A
sentence of fewer or more words than the word range is dropped, and so is any sentence seen before.
"""

from __future__ import annotations

import re
from pathlib import Path

from asrflow.errors import AsrflowError

FORTUNES_DIR = Path("/usr/share/games/fortunes")
FORTUNE_PACKAGES = "fortunes fortunes-min"
#: Fortune files left out: drawings made of characters, and text in other languages.
SKIPPED_FILES = frozenset({"ascii-art", "translate-me"})
#: Fewest and most words of a usable sentence.
SENTENCE_WORDS = (3, 20)
_PLAIN = re.compile(r"[A-Za-z ,;:.!?'\"()\-]+")
_ACRONYM = re.compile(r"\b[A-Z]{2,}\b")
_APOSTROPHES = str.maketrans({"\u2018": "'", "\u2019": "'", "`": "'"})
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def fortunes_missing(root: Path = FORTUNES_DIR) -> str | None:
    """Why the fortune files cannot be read here (``None`` when they can)."""
    if not root.is_dir() or not fortune_files(root):
        return f"no fortune files in {root} (Debian/Ubuntu: apt-get install {FORTUNE_PACKAGES})"
    return None


def fortune_files(root: Path) -> list[Path]:
    """The fortune text files directly in ``root``, by name: not their ``.dat`` indexes, ``.u8`` links,
    subfolders (``off/``: the offensive ones) or :data:`SKIPPED_FILES`."""
    return sorted(
        path
        for path in root.iterdir()
        if path.is_file()
        and not path.is_symlink()
        and path.suffix not in (".dat", ".u8")
        and path.name not in SKIPPED_FILES
    )


def raw_sentences(text: str) -> list[str]:
    """The sentences of a fortune file's text, as written: fortunes split at ``%`` lines, attribution
    lines (starting ``--``) dropped, each fortune joined into one line and split after ``.``, ``!``, ``?``."""
    found = []
    for fortune in re.split(r"^%\s*$", text.translate(_APOSTROPHES), flags=re.MULTILINE):
        body = " ".join(line.strip() for line in fortune.splitlines() if not line.strip().startswith("--"))
        found.extend(sentence.strip() for sentence in _SENTENCE_END.split(body) if sentence.strip())
    return found


def normalise_sentence(sentence: str, word_range: tuple[int, int] = SENTENCE_WORDS) -> str | None:
    """``sentence`` lowercase, without punctuation, apostrophes inside words only; ``None`` when it is not
    usable (a character espeak-ng does not read plainly, an acronym, a stray letter, too few or many words)."""
    if not _PLAIN.fullmatch(sentence) or _ACRONYM.search(sentence):
        return None
    letters = re.sub(r"[^a-z']", " ", sentence.lower())
    words = [word.strip("'") for word in letters.split()]
    words = [word for word in words if word]
    if any(len(word) == 1 and word not in ("a", "i") for word in words):
        return None
    if not word_range[0] <= len(words) <= word_range[1]:
        return None
    return " ".join(words)


def load_sentences(source: Path | None = None, word_range: tuple[int, int] = SENTENCE_WORDS) -> list[str]:
    """The usable sentences of ``source`` (a folder of fortune files or one text file; default
    :data:`FORTUNES_DIR`), normalised, each once, in the order the files (by name) hold them.

    Raises:
        AsrflowError: the source is missing or unreadable, naming the package to install.
    """
    source = Path(source) if source is not None else FORTUNES_DIR
    if source == FORTUNES_DIR and fortunes_missing(source):
        raise AsrflowError(f"sentences: {fortunes_missing(source)}")
    if not source.exists():
        raise AsrflowError(f"sentences: {source} does not exist; give a text file or a folder of fortune files")
    files = fortune_files(source) if source.is_dir() else [source]
    found: dict[str, None] = {}
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as error:
            raise AsrflowError(f"sentences: {path}: {error}") from None
        for sentence in raw_sentences(text):
            normal = normalise_sentence(sentence, word_range)
            if normal is not None:
                found.setdefault(normal)
    return list(found)
