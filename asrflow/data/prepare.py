"""The ``prepare`` stage: a corpus -> validated Lhotse manifests for train, dev and test.

:func:`prepare_corpus` reads the corpus (:mod:`asrflow.data.importers`), checks every
utterance (:mod:`asrflow.data.validation`, text rules in :mod:`asrflow.data.text`), and
writes into ``output_dir``, whole or not at all:

* ``{split}_recordings.jsonl.gz``, ``{split}_supervisions.jsonl.gz`` and
  ``{split}_cuts.jsonl.gz`` for ``train``, ``dev`` and each test set (``test``, or the
  names ``splits.test`` gives): one cut per utterance with its one supervision
  (``trim_to_supervisions(keep_overlapping=False)``);
* ``splits.json``: the test sets' names, when they are other than the one ``test``
  (:func:`asrflow.data.manifests.list_test_sets`);
* ``rejected.jsonl``: one object per rejected item (``split``, ``id``, ``path``,
  ``reason``, ``detail``);
* ``summary.json``: counts, hours and sampling rates per split, rejections by reason.

**Splits.** ``prepare.splits`` maps our split (``train``, ``dev``, ``test``) to the
corpus' split name: a recipe's key (``train-clean-100``), a TSV's name, or a Kaldi folder.
A list of names merges them (``train: [train-clean-100, train-clean-360]``). ``train``
must be named; ``dev`` or ``test`` left empty (``null``, or left out) is *carved* from
train after validation, in whole speaker (or recording) groups, by the rule of
:mod:`asrflow.data.carving`; the same corpus, params and seed always give the same split.
``test`` may name several test sets, each scored on its own by ``evaluate``
(:meth:`PrepareConfig.test_sources`): ``test: [test-clean, test-other]``, or a mapping
``{clean: test-clean, other: test-other}`` to choose their names.

**Duration limits** (``min_duration_s``, ``max_duration_s``, ``long_utterances``) apply to
train only: a corpus' own dev and test are kept as published (comparable with published
WERs); carved splits come from the filtered train. Corrupt audio, empty transcripts and
the other reasons of :mod:`asrflow.data.validation` are rejected in every split.

**Streaming.** The corpus is read, checked and written an utterance at a time; the
manifests are sorted by id on disk (:class:`~asrflow.data.spool.SortedSpool`) inside the
output's temporary folder. What memory holds that grows with the corpus: the ids kept so
far (duplicate check), one count per speaker and per recording (carving), and what an
importer holds (:func:`~asrflow.data.importers.stream_kaldi`).

**Rejections.** A bad item is rejected with a reason and never stops the others. When
rejected / (kept + rejected) exceeds ``max_rejected_fraction`` the stage fails with
:class:`~asrflow.errors.AsrflowError` naming the counts and the top reasons; it then
writes no manifests, but leaves the full report next to the output folder as
``<output_dir>.rejected.jsonl`` (removed again by the next successful run). A split
piece (``long_utterances: split``) counts as one item.

**Reproducibility.** Manifests are sorted by id (``rejected.jsonl`` is in split, then
corpus order), gzip headers carry no time stamp and no file name, and nothing records
the time: the same inputs give byte-identical files. Audio
paths that lie under the current working directory (the repository root, where stages
run) are written relative to it, so manifests stay valid when the repository is cloned or
moved; other paths are written absolute.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lhotse import SupervisionSegment
from lhotse.utils import fastcopy

from asrflow.data.carving import GroupCounter, plan_carving
from asrflow.data.importers import (
    PROBE_CHUNK,
    UNSPLIT,
    Item,
    cached_recipe,
    chunked,
    stream_folder,
    stream_kaldi,
    stream_recipe_split,
)
from asrflow.data.manifests import CORPUS_NAME, check_test_set_name, write_test_set_list
from asrflow.data.split_writer import SplitWriter, cut_dict, portable, recording_dict
from asrflow.data.spool import DEFAULT_CHUNK_LINES, SortedSpool
from asrflow.data.text import TextConfig
from asrflow.data.validation import Rejection, SplitValidator, ValidationRules
from asrflow.errors import AsrflowError
from asrflow.files import atomic_path
from asrflow.logs import progress
from asrflow.params import build_config, require_mapping

logger = logging.getLogger("asrflow")

#: Our split names, in the order they are read and validated.
SPLITS = ("train", "dev", "test")
#: Accepted values of ``prepare.long_utterances``.
LONG_UTTERANCE_MODES = ("drop", "split")
#: Values of ``prepare.corpus`` that are not Lhotse recipes.
OWN_FORMATS = ("folder", "kaldi")
#: features settings, which one entry of ``prepare.corpora`` may not set (every corpus shares them).
FEATURE_KEYS = frozenset({"sampling_rate", "num_mel_bins", "frame_shift_s", "frame_length_s", "on_the_fly"})


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    """The ``prepare`` section of ``params.yaml`` (see the comments there).

    Attributes:
        corpus: a Lhotse recipe name, ``folder`` or ``kaldi``.
        corpus_dir: the corpus folder (relative to the working directory, or absolute).
        recipe_args: extra keyword arguments for the Lhotse recipe.
        splits: our split -> the corpus' split name(s), or ``None`` to carve it from train;
            ``test`` may also name several test sets (:meth:`test_sources`).
        dev_fraction: share of train utterances carved into dev when it is empty, in [0, 1).
        test_fraction: share of train utterances carved into test when it is empty, in [0, 1).
        min_duration_s: shorter utterances are rejected (seconds).
        max_duration_s: longer utterances are dropped or split (seconds).
        long_utterances: ``drop`` or ``split``.
        channel: ``mix`` or a channel index for multi-channel audio.
        max_rejected_fraction: the stage fails above this share of rejected items.
        text: transcript normalisation settings.
        corpora: several corpora, prepared together (:meth:`corpus_configs`), or ``None`` for the one
            the keys above describe.
    """

    corpus: str = "yesno"
    corpus_dir: str = "data/corpora/yesno"
    recipe_args: dict[str, Any] = field(default_factory=dict)
    splits: dict[str, Any] = field(default_factory=lambda: {"train": "train", "dev": None, "test": "test"})
    dev_fraction: float = 0.1
    test_fraction: float = 0.1
    min_duration_s: float = 0.1
    max_duration_s: float = 30.0
    long_utterances: str = "drop"
    channel: str | int = "mix"
    max_rejected_fraction: float = 0.05
    text: TextConfig = field(default_factory=TextConfig)
    corpora: list[Any] | None = None

    @classmethod
    def from_section(cls, section: dict[str, Any] | None) -> PrepareConfig:
        """Build and check the config from the ``prepare`` section of ``params.yaml``.

        Raises:
            AsrflowError: an unknown key, a wrong type, or a value out of range.
        """
        section = dict(require_mapping(section, "prepare"))
        section["text"] = build_config(TextConfig, section.pop("text", None), "prepare.text")
        config = build_config(cls, section, "prepare")
        config.corpus_configs()  # checks prepare.corpora
        return config

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> AsrflowError:
            value = getattr(self, key)
            return AsrflowError(f"params.yaml: prepare.{key} = {value!r} {why}")

        if not self.corpus.strip():
            raise bad("corpus", "is empty; name a Lhotse recipe, or use folder or kaldi")
        if not 0.0 <= self.dev_fraction < 1.0:
            raise bad("dev_fraction", "must be in [0, 1)")
        if not 0.0 <= self.test_fraction < 1.0:
            raise bad("test_fraction", "must be in [0, 1)")
        if self.dev_fraction + self.test_fraction >= 1.0:
            raise bad("test_fraction", f"plus dev_fraction ({self.dev_fraction}) must be below 1")
        if not 0.0 <= self.max_rejected_fraction <= 1.0:
            raise bad("max_rejected_fraction", "must be in [0, 1]")
        if self.min_duration_s < 0:
            raise bad("min_duration_s", "must be >= 0")
        if self.max_duration_s <= self.min_duration_s:
            raise bad("max_duration_s", f"must be greater than min_duration_s = {self.min_duration_s}")
        if self.long_utterances not in LONG_UTTERANCE_MODES:
            raise bad("long_utterances", f"must be one of {', '.join(LONG_UTTERANCE_MODES)}")
        if (
            isinstance(self.channel, str)
            and self.channel != "mix"
            or (isinstance(self.channel, int) and self.channel < 0)
        ):
            raise bad("channel", "must be 'mix' or a channel index >= 0")
        self.split_sources()  # checks prepare.splits

    def split_sources(self) -> dict[str, list[str]]:
        """Each split to write -> the corpus' split names it merges (an empty list: carve it from train).

        The keys are ``train``, ``dev``, then the test sets in the order ``splits.test``
        gives them (see :meth:`test_sources`).

        Raises:
            AsrflowError: when ``splits`` has an unknown key, no train, a bad value, or
            names one corpus split for two of ours.
        """
        unknown = sorted(set(self.splits) - set(SPLITS))
        if unknown:
            raise AsrflowError(
                f"params.yaml: prepare.splits has unknown key(s) {', '.join(unknown)}; use {', '.join(SPLITS)}"
            )
        sources = {
            split: _source_names(self.splits.get(split), f"prepare.splits.{split}") for split in ("train", "dev")
        }
        sources.update(self.test_sources())
        owner: dict[str, str] = {}
        for split, names in sources.items():
            for name in names:
                if name in owner:
                    raise AsrflowError(
                        f"params.yaml: prepare.splits names {name!r} for both {owner[name]} and {split}; "
                        "give each split its own data (or null to carve it from train)"
                    )
                owner[name] = split
        if not sources["train"]:
            raise AsrflowError("params.yaml: prepare.splits.train must name the corpus' training split")
        return sources

    def test_sources(self) -> dict[str, list[str]]:
        """Each test set's name -> the corpus' split names it merges, from ``splits.test``.

        ``null`` carves one test set, ``test``, from train; a name (or a list merged into
        one) is the one test set ``test``; a list gives one test set per name, named after
        it; a mapping names each test set itself
        (``{clean: test-clean, noisy: [test-other, dev-other]}``, a list merging its names).

        Raises:
            AsrflowError: a value of another shape, or a name a test set cannot have.
        """
        value = self.splits.get("test")
        if isinstance(value, dict):
            if not value:
                raise AsrflowError("params.yaml: prepare.splits.test = {} names no test set; give one, or null")
            return {
                check_test_set_name(name, "params.yaml: prepare.splits.test"): _source_names(
                    names, f"prepare.splits.test.{name}", required=True
                )
                for name, names in value.items()
            }
        if isinstance(value, list) and value:
            names = _source_names(value, "prepare.splits.test")
            hint = "; a list names each test set after its split: to name them yourself, use a mapping {name: split}"
            for name in names:
                check_test_set_name(name, "params.yaml: prepare.splits.test", hint)
            return {name: [name] for name in names}
        return {"test": _source_names(value, "prepare.splits.test")}

    def corpus_configs(self) -> list[tuple[str | None, PrepareConfig]]:
        """Each corpus to prepare: its name (``None`` for the one corpus of the plain form) and its config.

        ``prepare.corpora`` lists corpora as mappings with a ``name`` and any keys of the
        ``prepare`` section (``corpus``, ``corpus_dir``, ``splits``, ``text``, ...); a key left
        out takes the section's value. The ``corpus_listing`` stage lists each entry's ``corpus_dir``
        (prepare's dependency, ``stages/corpus_listing.py``).

        Raises:
            AsrflowError: a name that is missing, repeats or cannot prefix ids, a weight or a
            features setting in an entry, or a bad value.
        """
        if not self.corpora:
            return [(None, self)]
        base = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("corpora", "text")}
        configs: list[tuple[str | None, PrepareConfig]] = []
        for number, entry in enumerate(self.corpora):
            where = f"params.yaml: prepare.corpora[{number}]"
            if not isinstance(entry, dict):
                raise AsrflowError(f"{where} = {entry!r} must be a mapping with a name and the keys of prepare")
            entry = dict(entry)
            name = entry.pop("name", None)
            if not isinstance(name, str) or not CORPUS_NAME.fullmatch(name):
                raise AsrflowError(
                    f"{where}: name = {name!r}; each corpus needs a name of letters, digits, '.', '_' and '-'"
                )
            where = f"{where} ({name})"
            if name in dict(configs):
                raise AsrflowError(f"params.yaml: prepare.corpora names {name!r} twice; give each corpus its own name")
            if "weight" in entry:
                raise AsrflowError(
                    f"{where}: weight belongs to training, where a change re-runs only the train stage: "
                    f"set train.data.corpus_weights: {{{name}: {entry['weight']!r}}}"
                )
            shared = sorted(set(entry) & FEATURE_KEYS)
            if shared:
                raise AsrflowError(
                    f"{where}: {', '.join(shared)} is a features setting, shared by every corpus (each is "
                    f"resampled to features.sampling_rate); set it in the features section"
                )
            if "corpora" in entry:
                raise AsrflowError(f"{where}: a corpus cannot list corpora")
            text = entry.pop("text", None)
            if text is not None:
                text = {**dataclasses.asdict(self.text), **require_mapping(text, f"{where}.text")}
            text = build_config(TextConfig, text, f"prepare.corpora[{number}].text") if text else self.text
            try:
                config = build_config(PrepareConfig, {**base, **entry, "text": text}, f"prepare.corpora[{number}]")
            except AsrflowError as error:  # a check of PrepareConfig names the key, not the entry
                raise AsrflowError(f"{where}: {str(error).removeprefix('params.yaml: ')}") from None
            configs.append((name, config))
        return configs


def _source_names(value: Any, key: str, *, required: bool = False) -> list[str]:
    """A ``prepare.splits`` value as the list of corpus split names it merges (``[]``: null, carve it)."""
    names = [value] if isinstance(value, str) else [] if value is None and not required else value
    if not (isinstance(names, list) and all(isinstance(n, str) and n.strip() for n in names)) or required and not names:
        shapes = "a split name or a list of names" if required else "a split name, a list of names, or null"
        raise AsrflowError(f"params.yaml: {key} = {value!r} must be {shapes}")
    return names


@dataclass(frozen=True, kw_only=True)
class SplitSummary:
    """What one split holds after preparation.

    Attributes:
        utterances: number of utterances (= cuts).
        recordings: number of recordings they come from.
        hours: total speech in hours (sum of utterance durations).
        sampling_rates: the recordings' native sampling rates, in Hz.
        multichannel_recordings: recordings with more than one channel.
        rejected: items of this split that were rejected.
        carved_from_train: whether the split was carved from train.
    """

    utterances: int
    recordings: int
    hours: float
    sampling_rates: list[int]
    multichannel_recordings: int
    rejected: int
    carved_from_train: bool


@dataclass(frozen=True, kw_only=True)
class PrepareSummary:
    """The outcome of :func:`prepare_corpus` (also written as ``summary.json``).

    Attributes:
        output_dir: where the manifests were written.
        corpus: the corpus kind (recipe name, folder or kaldi).
        channel: the channel setting used for multi-channel audio.
        splits: per-split counts.
        total_hours: hours of speech over all splits.
        rejected_by_reason: rejected item counts by reason code.
        rejected_total: number of rejected items.
        items_total: kept utterances + rejected items.
    """

    output_dir: Path
    corpus: str
    channel: str | int
    splits: dict[str, SplitSummary]
    total_hours: float
    rejected_by_reason: dict[str, int]
    rejected_total: int
    items_total: int

    @property
    def rejected_fraction(self) -> float:
        """rejected / (kept + rejected), 0 for an empty corpus."""
        return self.rejected_total / self.items_total if self.items_total else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The JSON form written to ``summary.json`` (no paths, no time stamps)."""
        return {
            "corpus": self.corpus,
            "channel": self.channel,
            "splits": {name: dataclasses.asdict(split) for name, split in self.splits.items()},
            "total_hours": self.total_hours,
            "rejected": {
                "total": self.rejected_total,
                "fraction": round(self.rejected_fraction, 6),
                "by_reason": dict(sorted(self.rejected_by_reason.items())),
            },
            "items_total": self.items_total,
        }


# --------------------------------------------------------------------------- reading


def recipe_cache_dir(output_dir: Path) -> Path:
    """Where a Lhotse recipe's own manifests are kept between runs: ``<output_dir>.recipe``."""
    return output_dir.with_name(output_dir.name + ".recipe")


def _streams(
    config: PrepareConfig, corpus_dir: Path, sources: dict[str, list[str]], cache_dir: Path
) -> dict[str, list[Callable[[], Iterator[Item]]]]:
    """Our split -> the streams of the corpus' splits it merges (opened when called)."""
    if config.corpus in OWN_FORMATS:
        reader = stream_folder if config.corpus == "folder" else stream_kaldi
        return {
            split: [functools.partial(reader, corpus_dir, name, split) for name in names]
            for split, names in sources.items()
            if names
        }
    folders = cached_recipe(config.corpus, corpus_dir, dict(config.recipe_args), cache_dir)
    for split, names in sources.items():
        for name in names:
            if name in folders:
                continue
            where = f"lhotse recipe prepare_{config.corpus} on {corpus_dir}"
            if not folders:
                raise AsrflowError(f"{where} gives no recordings; check corpus_dir and prepare.recipe_args")
            if list(folders) == [UNSPLIT]:
                raise AsrflowError(
                    f"params.yaml: prepare.splits.{_param_key(split)} = {name!r}, but {where} gives one unsplit set "
                    f"(no split names); set prepare.splits to {{train: {UNSPLIT}, dev: null, test: null}} "
                    "to carve dev and test from it (prepare.dev_fraction, prepare.test_fraction)"
                )
            raise AsrflowError(
                f"params.yaml: prepare.splits.{_param_key(split)} = {name!r}, but {where} gives the splits "
                f"{', '.join(sorted(folders))}; pick from those (a list merges several)"
            )
    return {
        split: [functools.partial(stream_recipe_split, folders[name], split) for name in names]
        for split, names in sources.items()
        if names
    }


def _param_key(split: str) -> str:
    """The ``prepare.splits`` key a split we write comes from (a test set's is ``test``)."""
    return split if split in ("train", "dev") else "test"


# --------------------------------------------------------------------------- carving


def carve_ids(supervisions: Iterable[SupervisionSegment], fraction: float, seed: int) -> set[str]:
    """The ids of the utterances that :mod:`asrflow.data.carving` moves out of train for one split.

    Args:
        supervisions: the kept train utterances.
        fraction: the share to move, in [0, 1).
        seed: orders the groups.
    """
    supervisions = list(supervisions)
    counter = GroupCounter()
    for supervision in supervisions:
        counter.add(supervision.id, supervision.recording_id, supervision.speaker)
    plan = plan_carving(counter, {"dev": fraction}, seed)
    return {s.id for s in supervisions if plan.split_of(s.id, s.recording_id, s.speaker) == "dev"}


def _check_fractions(carved: list[str], config: PrepareConfig) -> None:
    fractions = {"dev": config.dev_fraction, "test": config.test_fraction}
    for split in carved:
        if fractions[split] <= 0:
            raise AsrflowError(
                f"params.yaml: prepare.splits.{split} is null (carve it from train) but "
                f"prepare.{split}_fraction is 0; set it above 0, or name the corpus' {split} split"
            )


def _check_carvable(counter: GroupCounter, carved: list[str], name: str | None = None) -> None:
    """Refuse a carve that would leave a split empty (before any manifest is written)."""
    groups = counter.groups()
    if carved and groups < len(carved) + 1:
        which = f"corpus {name}'s " if name else ""
        raise AsrflowError(
            f"cannot carve {' and '.join(carved)} from {which}train: train holds {counter.utterances} usable "
            f"utterance(s) in {groups} group(s), and each carved split needs one group with one left for train "
            f"(at least {len(carved) + 1}); add data, or name the corpus' {' and '.join(carved)} split(s) "
            "in prepare.splits"
        )


# --------------------------------------------------------------------------- rejections and summary


class _RejectionLog:
    """Rejected items, written to ``rejected.jsonl`` as they come (split order, then corpus order)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handle = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.by_reason: Counter = Counter()
        self.by_split: Counter = Counter()
        self.first: list[Rejection] = []

    def add(self, rejection: Rejection) -> None:
        self.handle.write(json.dumps(rejection.to_dict(), ensure_ascii=False, sort_keys=True) + "\n")
        self.by_reason[rejection.reason] += 1
        self.by_split[rejection.split] += 1
        if len(self.first) < 10:
            self.first.append(rejection)

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    def close(self) -> None:
        self.handle.close()


def _log_summary(summary: PrepareSummary, rejections: _RejectionLog) -> None:
    for name, split in summary.splits.items():
        carved = " (carved from train)" if split.carved_from_train else ""
        logger.info(
            "prepare: %-5s %6d utterances, %6d recordings, %8.3f h, rates %s Hz, %d rejected%s",
            name,
            split.utterances,
            split.recordings,
            split.hours,
            split.sampling_rates,
            split.rejected,
            carved,
        )
    logger.info(
        "prepare: %.3f h in all; rejected %d of %d items (%.1f%%)%s",
        summary.total_hours,
        summary.rejected_total,
        summary.items_total,
        100 * summary.rejected_fraction,
        "".join(f", {reason}: {count}" for reason, count in Counter(summary.rejected_by_reason).most_common()),
    )
    for rejection in rejections.first:
        logger.warning("rejected %s/%s (%s): %s", rejection.split, rejection.id, rejection.reason, rejection.detail)
    if rejections.total > len(rejections.first):
        logger.warning("... and %d more rejected items, see rejected.jsonl", rejections.total - len(rejections.first))


def _check_rejected(
    rejections: _RejectionLog, *, kept: int, rejected: int, config: PrepareConfig, report: Path
) -> None:
    """Fail when ``rejected`` of a corpus' items exceed its ``max_rejected_fraction``, leaving the full report
    at ``report``."""
    items = kept + rejected
    fraction = rejected / items if items else 0.0
    if fraction <= config.max_rejected_fraction:
        return
    rejections.close()
    os.replace(rejections.path, report)
    top = ", ".join(f"{reason}: {count}" for reason, count in rejections.by_reason.most_common(3))
    examples = "; ".join(f"{r.split}/{r.id}: {r.detail}" for r in rejections.first[:2])
    raise AsrflowError(
        f"{rejected} of {items} items rejected "
        f"({100 * fraction:.1f}% > max_rejected_fraction "
        f"{100 * config.max_rejected_fraction:.1f}%); top reasons: {top}; e.g. {examples}. "
        f"Every rejected item is listed in {report}: fix the corpus, or raise "
        "prepare.max_rejected_fraction in params.yaml"
    )


# --------------------------------------------------------------------------- entry point


def _validate_into_spool(
    split: str,
    streams: list[Callable[[], Iterator[Item]]],
    *,
    validator: SplitValidator,
    spool: SortedSpool,
    rejections: _RejectionLog,
    counter: GroupCounter | None,
    cwd: Path,
    prefix: str = "",
) -> int:
    """Read, check and spool one split's cuts (JSON keyed by id, ``prefix`` put before every id);
    returns how many were kept."""
    kept = 0
    items = progress(itertools.chain.from_iterable(stream() for stream in streams), f"prepare: reading {split}")
    for chunk in chunked(items, PROBE_CHUNK):
        candidates = []
        for item in chunk:
            if isinstance(item, Rejection):
                rejections.add(item)
            else:
                candidates.append(item)
        for outcome in validator.check(candidates):
            if isinstance(outcome, Rejection):
                rejections.add(outcome)
                continue
            recording = recording_dict(portable(outcome.recording, cwd))
            if prefix:
                recording["id"] = prefix + recording["id"]
            for piece in outcome.pieces:
                if prefix:
                    piece = fastcopy(piece, id=prefix + piece.id, recording_id=recording["id"])
                spool.add(piece.id, json.dumps(cut_dict(recording, piece), ensure_ascii=False))
                if counter is not None:
                    counter.add(piece.id, piece.recording_id, piece.speaker)
                kept += 1
    return kept


@dataclass(kw_only=True)
class _Corpus:
    """One corpus being prepared: its name (``None``: the one corpus of the plain form), its
    config, its splits (train, dev, its test sets) -> the corpus' split names, and its carving."""

    name: str | None
    config: PrepareConfig
    sources: dict[str, list[str]]
    carved: list[str]
    streams: dict[str, list[Callable[[], Iterator[Item]]]]
    counter: GroupCounter = field(default_factory=GroupCounter)
    plan: Any = None

    @classmethod
    def open(cls, name: str | None, config: PrepareConfig, output_dir: Path) -> _Corpus:
        """Check the corpus folder and splits, and open the streams (a recipe runs here, or is read from its cache)."""
        corpus_dir = Path(config.corpus_dir)
        if not corpus_dir.is_dir():
            key = "prepare.corpus_dir" if name is None else f"corpus_dir of prepare.corpora {name}"
            raise AsrflowError(
                f"corpus_dir {corpus_dir} does not exist or is not a folder ({key} in params.yaml); "
                "point it at the folder that holds the corpus"
            )
        sources = config.split_sources()
        carved = [split for split in ("dev", "test") if split in sources and not sources[split]]
        cache = recipe_cache_dir(output_dir)
        cache = cache if name is None else cache.with_name(f"{cache.name}.{name}")
        streams = _streams(config, corpus_dir, sources, cache)
        _check_fractions(carved, config)
        return cls(name=name, config=config, sources=sources, carved=carved, streams=streams)

    @property
    def prefix(self) -> str:
        """What this corpus' cut, recording and test set names start with (nothing for the plain form)."""
        return f"{self.name}/" if self.name else ""

    def target(self, split: str) -> str:
        """The split we write this corpus' ``split`` into: train and dev are shared, a test set is its own."""
        return split if split in ("train", "dev") else self.prefix + split

    def label(self, split: str) -> str:
        """``split`` as rejected.jsonl names it (``<corpus>/train`` when there are several corpora)."""
        return self.prefix + split

    def rules(self) -> ValidationRules:
        return ValidationRules(
            min_duration_s=self.config.min_duration_s,
            max_duration_s=self.config.max_duration_s,
            long_utterances=self.config.long_utterances,
            channel=self.config.channel,
            text=self.config.text,
        )


def prepare_corpus(
    config: PrepareConfig, output_dir: Path, seed: int, *, chunk_lines: int = DEFAULT_CHUNK_LINES
) -> PrepareSummary:
    """Read, check and split the corpus (or each of ``prepare.corpora``); write the manifests into ``output_dir``.

    The corpus streams through: memory holds one sort chunk of ``chunk_lines`` manifest
    lines, the ids kept so far (duplicate check), and per-group counts for carving
    (:mod:`asrflow.data.carving`); the manifests are sorted on disk
    (:class:`~asrflow.data.spool.SortedSpool`) inside the output's temporary folder.

    Several corpora (:meth:`PrepareConfig.corpus_configs`) are each read, checked and carved
    with their own settings; every id gets the corpus' name and ``/`` in front; train and dev
    hold every corpus' utterances, and each corpus' test sets are named ``<corpus>/<test set>``.

    Args:
        config: the ``prepare`` section of ``params.yaml``.
        output_dir: the folder to create (replaced whole when it exists).
        seed: the shared seed (dev/test carving).
        chunk_lines: manifest lines sorted in memory at a time.

    Returns:
        The summary, also written as ``output_dir/summary.json``.

    Raises:
        AsrflowError: a missing corpus folder or split, an unknown recipe, a failing
        recipe, a split left empty, or too many rejected items.
    """
    output_dir = Path(output_dir)
    corpora = [_Corpus.open(name, sub, output_dir) for name, sub in config.corpus_configs()]
    by_name = {corpus.name: corpus for corpus in corpora}
    written = list(dict.fromkeys(corpus.target(split) for corpus in corpora for split in corpus.sources))
    carved_into = {corpus.target(split) for corpus in corpora for split in corpus.carved}
    report = output_dir.with_name(output_dir.name + ".rejected.jsonl")
    cwd = Path.cwd()
    with atomic_path(output_dir) as tmp:
        tmp.mkdir()
        work = tmp / ".work"
        work.mkdir()
        rejections = _RejectionLog(tmp / "rejected.jsonl")
        streamed = list(dict.fromkeys(corpus.target(split) for corpus in corpora for split in corpus.streams))
        spools = {
            target: SortedSpool(work, f"{index}_cuts", chunk_lines=chunk_lines) for index, target in enumerate(streamed)
        }
        kept_in_all = 0
        for corpus in corpora:
            seen: set[str] = set()
            kept = 0
            for split in corpus.streams:
                # Only train is filtered by duration: a corpus' own dev and test stay as published.
                validator = SplitValidator(corpus.label(split), corpus.rules(), seen, duration_limits=split == "train")
                kept += _validate_into_spool(
                    corpus.label(split),
                    corpus.streams[split],
                    validator=validator,
                    spool=spools[corpus.target(split)],
                    rejections=rejections,
                    counter=corpus.counter if split == "train" else None,
                    cwd=cwd,
                    prefix=corpus.prefix,
                )
            rejected = sum(rejections.by_split[corpus.label(split)] for split in corpus.streams)
            _check_rejected(rejections, kept=kept, rejected=rejected, config=corpus.config, report=report)
            kept_in_all += kept
        rejections.close()
        for corpus in corpora:
            _check_carvable(corpus.counter, corpus.carved, corpus.name)
            fractions = {"dev": corpus.config.dev_fraction, "test": corpus.config.test_fraction}
            corpus.plan = plan_carving(corpus.counter, {split: fractions[split] for split in corpus.carved}, seed)

        writers = {split: SplitWriter(tmp, split, work, chunk_lines=chunk_lines) for split in written}
        for target, spool in spools.items():  # train first, so that what it carves can join a spool read later
            for _, line in spool.drain():
                cut = json.loads(line)
                destination = target
                corpus = corpora[0] if len(corpora) == 1 else by_name[cut["id"].split("/", 1)[0]]
                if target == "train" and corpus.carved:
                    speaker = cut["supervisions"][0].get("speaker")
                    destination = corpus.target(corpus.plan.split_of(cut["id"], cut["recording"]["id"], speaker))
                if destination != target and destination in spools:
                    # dev carved from one corpus and read from another: sorted together, as one split
                    spools[destination].add(cut["id"], line)
                else:
                    writers[destination].write(line, cut)
        for writer in writers.values():
            writer.close()
        work.rmdir()

        labels = Counter()
        for corpus in corpora:
            for split in corpus.streams:
                labels[corpus.target(split)] += rejections.by_split[corpus.label(split)]
        summaries = {
            split: SplitSummary(
                utterances=writer.utterances,
                recordings=writer.recordings,
                hours=round(writer.seconds / 3600, 6),
                sampling_rates=sorted(writer.sampling_rates),
                multichannel_recordings=writer.multichannel,
                rejected=labels[split],
                carved_from_train=split in carved_into,
            )
            for split, writer in writers.items()
        }
        summary = PrepareSummary(
            output_dir=output_dir,
            corpus=", ".join(f"{c.name}: {c.config.corpus}" if c.name else c.config.corpus for c in corpora),
            channel=config.channel,
            splits=summaries,
            total_hours=round(sum(s.hours for s in summaries.values()), 6),
            rejected_by_reason=dict(rejections.by_reason),
            rejected_total=rejections.total,
            items_total=kept_in_all + rejections.total,
        )
        _log_summary(summary, rejections)
        for split in written:
            if not summaries[split].utterances:
                how = (
                    "carving from train left it empty (train too small?)" if split in carved_into else "no usable items"
                )
                raise AsrflowError(
                    f"split {split!r} is empty after preparation ({how}); add data, fix prepare.splits, "
                    "or look at the rejected items in the log"
                )
        tests = [split for split in written if split not in ("train", "dev")]
        write_test_set_list(tmp, tests, [corpus.name for corpus in corpora if corpus.name])
        (tmp / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2, sort_keys=True) + "\n")
    report.unlink(missing_ok=True)
    logger.info("prepare: manifests written to %s", output_dir)
    return summary
