"""Where cut manifests live and how to read them.

A manifests folder (``data/manifests``, and ``data/fbank`` after it) holds a ``train``
and a ``dev`` split and one or more *test sets*, each a split of its own with a name:
``test`` when the corpus has one test split, else the names ``prepare.splits.test``
gives (``test-clean``, ``test-other``). A name is one or more ``/``-separated parts of
letters, digits, ``.``, ``_`` and ``-`` (``librispeech/test-clean``: a sub-folder).
:data:`SPLITS_FILE` lists the test sets when they are other than the one ``test``, and
the corpora when ``prepare.corpora`` names several: then every cut and recording id starts
with its corpus' name and ``/`` (:func:`corpus_of_ids`), train and dev hold every corpus'
utterances, and each corpus' test sets are named ``<corpus>/<test set>``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import numpy as np
from lhotse import CutSet

from asrflow.errors import AsrflowError

SPLITS = ("train", "dev", "test")
#: The test sets of a folder that has no :data:`SPLITS_FILE`: the one split ``test``.
DEFAULT_TEST_SETS = ("test",)
#: ``{"test": [names], "corpora": [names]}`` beside the manifests, written when the test sets are not
#: :data:`DEFAULT_TEST_SETS` or there are named corpora (``corpora`` left out when there are none).
SPLITS_FILE = "splits.json"
#: What a test set's name may be (see the module docstring).
TEST_SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")
#: What a corpus' name may be: one part of a test set's name (it prefixes ids and test sets with ``/``).
CORPUS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

T = TypeVar("T")


def cuts_path(directory: str | Path, split: str) -> Path:
    """Where a split's cuts live, in ``data/manifests`` and ``data/fbank`` alike."""
    return Path(directory) / f"{split}_cuts.jsonl.gz"


def check_test_set_name(name: object, where: str, hint: str = "") -> str:
    """``name`` when it can name a test set (:data:`TEST_SET_NAME`, not ``train`` or ``dev``).

    Raises:
        AsrflowError: naming ``where`` the name came from and what a name may hold (then ``hint``).
    """
    if not isinstance(name, str) or not TEST_SET_NAME.fullmatch(name) or name in ("train", "dev"):
        raise AsrflowError(
            f"{where}: {name!r} cannot name a test set; use letters, digits, '.', '_' and '-' "
            f"(parts joined by '/'), other than train and dev{hint}"
        )
    return name


def list_test_sets(directory: str | Path) -> list[str]:
    """The test sets of a manifests or features folder, in the order params.yaml gives them.

    Raises:
        AsrflowError: :data:`SPLITS_FILE` is there but does not list test sets.
    """
    path = Path(directory) / SPLITS_FILE
    if not path.is_file():
        return list(DEFAULT_TEST_SETS)
    names = json.loads(path.read_text()).get("test")
    if not isinstance(names, list) or not names:
        raise AsrflowError(f"{path} lists no test sets: run the prepare stage again")
    return [check_test_set_name(name, str(path)) for name in names]


def write_test_set_list(directory: str | Path, names: Iterable[str], corpora: Iterable[str] = ()) -> None:
    """Record the test sets (and named corpora) of ``directory`` for :func:`list_test_sets` and
    :func:`list_corpora` (nothing to write for the one ``test`` of one unnamed corpus)."""
    names, corpora = list(names), list(corpora)
    if tuple(names) != DEFAULT_TEST_SETS or corpora:
        listing = {"test": names, **({"corpora": corpora} if corpora else {})}
        (Path(directory) / SPLITS_FILE).write_text(json.dumps(listing, indent=2) + "\n")


def list_corpora(directory: str | Path) -> list[str]:
    """The named corpora of a manifests or features folder (``[]``: one corpus, ids unprefixed)."""
    path = Path(directory) / SPLITS_FILE
    if not path.is_file():
        return []
    return list(json.loads(path.read_text()).get("corpora", []))


def corpus_of_ids(ids: np.ndarray, corpora: list[str]) -> np.ndarray:
    """``(N,)`` int64: the index in ``corpora`` of each id's corpus (its prefix before ``/``).

    Args:
        ids: ``(N,)`` UTF-8 bytes, ids of cuts of a folder with named ``corpora``.
    Raises:
        AsrflowError: an id with no listed corpus' prefix (the folder was not written by prepare).
    """
    owner = np.full(len(ids), -1, dtype=np.int64)
    for number, name in enumerate(corpora):
        owner[np.char.startswith(ids, f"{name}/".encode())] = number
    if len(ids) and owner.min() < 0:
        stray = ids[int(np.argmin(owner))].decode()
        raise AsrflowError(f"cut {stray!r} belongs to none of the corpora {corpora}: run the prepare stage again")
    return owner


def split_names(directory: str | Path) -> list[str]:
    """Every split of a manifests or features folder: ``train``, ``dev``, then the test sets."""
    return ["train", "dev", *list_test_sets(directory)]


def load_cuts(directory: str | Path, split: str) -> CutSet:
    """Read one split's cuts, with a clear error when the stage before has not run.

    The CutSet is lazy: it reads the ``jsonl.gz`` file as it is iterated (constant memory,
    no random access, each iteration reads again). Call ``.to_eager()`` for random access.
    """
    path = cuts_path(directory, split)
    if not path.is_file():
        raise AsrflowError(f"{path} not found: run the stage that writes it first")
    return CutSet.from_jsonl_lazy(path)


def join_texts(texts: Iterable[str | None]) -> str:
    """A cut's transcript from its supervisions' texts: the non-empty ones, joined by spaces."""
    return " ".join(text for text in texts if text)


def cut_text(cut) -> str:
    """The transcript of a cut (:func:`join_texts` of its supervisions' texts)."""
    return join_texts(s.text for s in cut.supervisions)


def entry_text(entry: dict) -> str:
    """:func:`cut_text` of a cut's manifest entry (its JSON object), with no ``Cut`` made."""
    return join_texts(s.get("text") for s in entry.get("supervisions", []))


def pack_by_duration(items: Iterable[T], duration_s: Callable[[T], float], max_seconds: float) -> list[list[T]]:
    """Consecutive ``items`` grouped into batches of at most ``max_seconds`` of audio, in order.

    Sort the items by duration first to keep padding small. An item longer than
    ``max_seconds`` forms a batch of its own.
    """
    batches: list[list[T]] = []
    current: list[T] = []
    total = 0.0
    for item in items:
        seconds = duration_s(item)
        if current and total + seconds > max_seconds:
            batches.append(current)
            current, total = [], 0.0
        current.append(item)
        total += seconds
    if current:
        batches.append(current)
    return batches


def pack_shortest_first(items: Iterable[T], duration_s: Callable[[T], float], max_seconds: float) -> list[list[T]]:
    """``items`` sorted by duration (seconds; stable: equal durations keep their order), then packed into
    batches of at most ``max_seconds`` (:func:`pack_by_duration`): similar lengths share a batch, so padding
    stays small."""
    return pack_by_duration(sorted(items, key=duration_s), duration_s, max_seconds)
