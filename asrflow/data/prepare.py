"""The ``prepare`` stage: a corpus -> validated Lhotse manifests for train, dev and test.

:func:`prepare_corpus` reads the corpus (:mod:`asrflow.data.importers`), checks every
utterance (:mod:`asrflow.data.validation`, text rules in :mod:`asrflow.data.text`), and
writes into ``output_dir``, whole or not at all:

* ``{split}_recordings.jsonl.gz``, ``{split}_supervisions.jsonl.gz`` and
  ``{split}_cuts.jsonl.gz`` for ``train``, ``dev`` and ``test``: one cut per utterance
  with its one supervision (``trim_to_supervisions(keep_overlapping=False)``);
* ``rejected.jsonl``: one object per rejected item (``split``, ``id``, ``path``,
  ``reason``, ``detail``);
* ``summary.json``: counts, hours and sampling rates per split, rejections by reason.

**Splits.** ``prepare.splits`` maps our split (``train``, ``dev``, ``test``) to the
corpus' split name: a recipe's key (``train-clean-100``), a TSV's name, or a Kaldi folder.
A list of names merges them (``train: [train-clean-100, train-clean-360]``). ``train``
must be named; ``dev`` or ``test`` left empty (``null``, or left out) is *carved* from
train after validation, by this rule:

1. n = the number of kept train utterances; nothing is carved when n < 2 or
   ``dev_fraction`` is 0. The target is k = max(1, round(dev_fraction * n)) utterances
   (Python's ``round``, half to even).
2. The train utterances are grouped by recording (so that segments of one recording stay
   together); when all of train comes from a single recording, each utterance is its own
   group.
3. The groups are sorted by id and shuffled with ``random.Random(seed)`` (``seed + 1`` for
   ``test``); whole groups move to the carved split, in that order, until it holds at
   least k utterances, always leaving at least one group in train.
4. ``dev`` is carved first, then ``test`` from what remains.

The same corpus, params and seed always give the same split.

**Rejections.** A bad item is rejected with a reason and never stops the others. When
rejected / (kept + rejected) exceeds ``max_rejected_fraction`` the stage fails with
:class:`~asrflow.errors.AsrflowError` naming the counts and the top reasons; it then
writes no manifests, but leaves the full report next to the output folder as
``<output_dir>.rejected.jsonl`` (removed again by the next successful run). A split
piece (``long_utterances: split``) counts as one item.

**Reproducibility.** Manifests are sorted by id, gzip headers carry no time stamp and no
file name, and nothing records the time: the same inputs give byte-identical files. Audio
paths that lie under the current working directory (the repository root, where stages
run) are written relative to it, so manifests stay valid when the repository is cloned or
moved; other paths are written absolute.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import os
import random
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lhotse import CutSet, Recording, RecordingSet, SupervisionSegment, SupervisionSet
from lhotse.utils import fastcopy

from asrflow.data.importers import UNSPLIT, ImportedSplit, import_folder, import_kaldi, run_recipe
from asrflow.data.text import TextConfig
from asrflow.data.validation import Rejection, ValidationRules, validate_split
from asrflow.errors import AsrflowError
from asrflow.files import atomic_path
from asrflow.params import build_config, require_mapping

logger = logging.getLogger("asrflow")

#: Our split names, in the order they are read and validated.
SPLITS = ("train", "dev", "test")
#: Accepted values of ``prepare.long_utterances``.
LONG_UTTERANCE_MODES = ("drop", "split")
#: Values of ``prepare.corpus`` that are not Lhotse recipes.
OWN_FORMATS = ("folder", "kaldi")


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    """The ``prepare`` section of ``params.yaml`` (see the comments there).

    Attributes:
        corpus: a Lhotse recipe name, ``folder`` or ``kaldi``.
        corpus_dir: the corpus folder (relative to the working directory, or absolute).
        recipe_args: extra keyword arguments for the Lhotse recipe.
        splits: our split -> the corpus' split name(s), or ``None`` to carve it from train.
        dev_fraction: share of train utterances carved into dev when it is empty, in [0, 1).
        test_fraction: share of train utterances carved into test when it is empty, in [0, 1).
        min_duration_s: shorter utterances are rejected (seconds).
        max_duration_s: longer utterances are dropped or split (seconds).
        long_utterances: ``drop`` or ``split``.
        channel: ``mix`` or a channel index for multi-channel audio.
        max_rejected_fraction: the stage fails above this share of rejected items.
        text: transcript normalisation settings.
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

    @classmethod
    def from_section(cls, section: dict[str, Any] | None) -> PrepareConfig:
        """Build and check the config from the ``prepare`` section of ``params.yaml``.

        Raises:
            AsrflowError: an unknown key, a wrong type, or a value out of range.
        """
        section = dict(require_mapping(section, "prepare"))
        section["text"] = build_config(TextConfig, section.pop("text", None), "prepare.text")
        return build_config(cls, section, "prepare")

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
        """Our split -> the corpus' split names (an empty list: carve it from train).

        Raises:
            AsrflowError: when ``splits`` has an unknown key, no train, a bad value, or
            names one corpus split for two of ours.
        """
        unknown = sorted(set(self.splits) - set(SPLITS))
        if unknown:
            raise AsrflowError(
                f"params.yaml: prepare.splits has unknown key(s) {', '.join(unknown)}; use {', '.join(SPLITS)}"
            )
        sources: dict[str, list[str]] = {}
        owner: dict[str, str] = {}
        for split in SPLITS:
            value = self.splits.get(split)
            names = [value] if isinstance(value, str) else value
            if names is None:
                names = []
            if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
                raise AsrflowError(
                    f"params.yaml: prepare.splits.{split} = {value!r} must be a split name, a list of names, or null"
                )
            for name in names:
                if name in owner:
                    raise AsrflowError(
                        f"params.yaml: prepare.splits names {name!r} for both {owner[name]} and {split}; "
                        "give each split its own data (or null to carve it from train)"
                    )
                owner[name] = split
            sources[split] = names
        if not sources["train"]:
            raise AsrflowError("params.yaml: prepare.splits.train must name the corpus' training split")
        return sources


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


# --------------------------------------------------------------------------- helpers


def _merge(parts: list[ImportedSplit]) -> ImportedSplit:
    if len(parts) == 1:
        return parts[0]
    recordings: dict[str, Recording] = {}
    supervisions: list[SupervisionSegment] = []
    rejected: list[Rejection] = []
    for part in parts:
        for recording in part.recordings:
            recordings.setdefault(recording.id, recording)
        supervisions.extend(part.supervisions)
        rejected.extend(part.rejected)
    return ImportedSplit(
        RecordingSet.from_recordings(recordings.values()), SupervisionSet.from_segments(supervisions), rejected
    )


def _import(config: PrepareConfig, corpus_dir: Path, sources: dict[str, list[str]]) -> dict[str, ImportedSplit]:
    """Read every named split of the corpus."""
    imported: dict[str, ImportedSplit] = {}
    if config.corpus in OWN_FORMATS:
        reader = import_folder if config.corpus == "folder" else import_kaldi
        for split, names in sources.items():
            if names:
                imported[split] = _merge([reader(corpus_dir, name, split) for name in names])
        return imported
    manifests = run_recipe(config.corpus, corpus_dir, dict(config.recipe_args))
    for split, names in sources.items():
        for name in names:
            if name in manifests:
                continue
            where = f"lhotse recipe prepare_{config.corpus} on {corpus_dir}"
            if not manifests:
                raise AsrflowError(f"{where} gives no recordings; check corpus_dir and prepare.recipe_args")
            if list(manifests) == [UNSPLIT]:
                raise AsrflowError(
                    f"params.yaml: prepare.splits.{split} = {name!r}, but {where} gives one unsplit set "
                    f"(no split names); set prepare.splits to {{train: {UNSPLIT}, dev: null, test: null}} "
                    "to carve dev and test from it (prepare.dev_fraction, prepare.test_fraction)"
                )
            raise AsrflowError(
                f"params.yaml: prepare.splits.{split} = {name!r}, but {where} gives the splits "
                f"{', '.join(sorted(manifests))}; pick from those (a list merges several)"
            )
        if names:
            imported[split] = _merge([manifests[name] for name in names])
    return imported


def carve_ids(supervisions: Iterable[SupervisionSegment], fraction: float, seed: int) -> set[str]:
    """The ids of the utterances to move out of train (the rule of this module's docstring).

    Args:
        supervisions: the kept train utterances.
        fraction: the share to move, in [0, 1).
        seed: seeds ``random.Random``.
    """
    supervisions = list(supervisions)
    total = len(supervisions)
    if total < 2 or fraction <= 0:
        return set()
    target = max(1, round(fraction * total))
    groups: dict[str, list[str]] = defaultdict(list)
    for supervision in supervisions:
        groups[supervision.recording_id].append(supervision.id)
    if len(groups) < 2:
        groups = {supervision.id: [supervision.id] for supervision in supervisions}
    order = sorted(groups)
    random.Random(seed).shuffle(order)
    moved: set[str] = set()
    for key in order[:-1]:
        if len(moved) >= target:
            break
        moved.update(groups[key])
    return moved


def carve_groups(supervisions: list[SupervisionSegment]) -> int:
    """How many groups :func:`carve_ids` can move: recordings, or utterances when all share one."""
    recordings = {supervision.recording_id for supervision in supervisions}
    return len(recordings) if len(recordings) >= 2 else len(supervisions)


def _check_carvable(train: list[SupervisionSegment], carved: list[str], config: PrepareConfig) -> None:
    """Refuse, before anything is written, a carve that would leave a split empty.

    Raises:
        AsrflowError: a zero fraction for a split to carve, or fewer groups than carved splits + 1.
    """
    if not carved:
        return
    fractions = {"dev": config.dev_fraction, "test": config.test_fraction}
    for split in carved:
        if fractions[split] <= 0:
            raise AsrflowError(
                f"params.yaml: prepare.splits.{split} is null (carve it from train) but "
                f"prepare.{split}_fraction is 0; set it above 0, or name the corpus' {split} split"
            )
    groups = carve_groups(train)
    if groups < len(carved) + 1:
        raise AsrflowError(
            f"cannot carve {' and '.join(carved)} from train: train holds {len(train)} usable utterance(s) in "
            f"{groups} recording group(s), and each carved split needs one group with one left for train "
            f"(at least {len(carved) + 1}); add data, or name the corpus' {' and '.join(carved)} split(s) "
            "in prepare.splits"
        )


def _subset(recordings: RecordingSet, supervisions: list[SupervisionSegment]) -> tuple[RecordingSet, SupervisionSet]:
    wanted = {s.recording_id for s in supervisions}
    return (
        RecordingSet.from_recordings(r for r in recordings if r.id in wanted),
        SupervisionSet.from_segments(sorted(supervisions, key=lambda s: s.id)),
    )


def _portable(recording: Recording, cwd: Path) -> Recording:
    """Write file paths under ``cwd`` relative to it (see "Reproducibility" above)."""
    sources = []
    for source in recording.sources:
        path = Path(source.source) if source.type == "file" else None
        if path is not None and path.is_absolute():
            normalised = Path(os.path.normpath(path))
            if normalised.is_relative_to(cwd):
                source = fastcopy(source, source=normalised.relative_to(cwd).as_posix())
        sources.append(source)
    return fastcopy(recording, sources=sources)


def _write_jsonl_gz(path: Path, items: Iterable[Any]) -> None:
    """Lhotse's jsonl.gz format, byte-reproducible: no time stamp, no name in the gzip header."""
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as stream:
        for item in items:
            stream.write((json.dumps(item.to_dict(), ensure_ascii=False) + "\n").encode("utf-8"))


def _sorted_rejections(rejected: list[Rejection]) -> list[Rejection]:
    order = {name: index for index, name in enumerate(SPLITS)}
    return sorted(rejected, key=lambda r: (order[r.split], r.id, r.reason, r.path or "", r.detail))


def _write_rejections(path: Path, rejected: list[Rejection]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for rejection in rejected:
            handle.write(json.dumps(rejection.to_dict(), ensure_ascii=False, sort_keys=True) + "\n")


def _log_summary(summary: PrepareSummary, rejected: list[Rejection]) -> None:
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
    for rejection in rejected[:10]:
        logger.warning("rejected %s/%s (%s): %s", rejection.split, rejection.id, rejection.reason, rejection.detail)
    if len(rejected) > 10:
        logger.warning("... and %d more rejected items, see rejected.jsonl", len(rejected) - 10)


# --------------------------------------------------------------------------- entry point


def prepare_corpus(config: PrepareConfig, output_dir: Path, seed: int) -> PrepareSummary:
    """Read, check and split the corpus; write the manifests into ``output_dir``.

    Args:
        config: the ``prepare`` section of ``params.yaml``.
        output_dir: the folder to create (replaced whole when it exists).
        seed: the shared seed (dev/test carving).

    Returns:
        The summary, also written as ``output_dir/summary.json``.

    Raises:
        AsrflowError: a missing corpus folder or split, an unknown recipe, a failing
        recipe, a split left empty, or too many rejected items.
    """
    output_dir = Path(output_dir)
    corpus_dir = Path(config.corpus_dir)
    if not corpus_dir.is_dir():
        raise AsrflowError(
            f"corpus_dir {corpus_dir} does not exist or is not a folder (prepare.corpus_dir in params.yaml); "
            "point it at the folder that holds the corpus"
        )
    sources = config.split_sources()
    imported = _import(config, corpus_dir, sources)

    rules = ValidationRules(
        min_duration_s=config.min_duration_s,
        max_duration_s=config.max_duration_s,
        long_utterances=config.long_utterances,
        channel=config.channel,
        text=config.text,
    )
    seen: set[str] = set()
    rejected: list[Rejection] = []
    splits: dict[str, tuple[RecordingSet, SupervisionSet]] = {}
    for split, part in imported.items():
        result = validate_split(split, part.recordings, supervisions=part.supervisions, rules=rules, seen_ids=seen)
        rejected.extend(part.rejected)
        rejected.extend(result.rejected)
        splits[split] = (result.recordings, result.supervisions)

    train_recordings, train_supervisions = splits["train"]
    remaining = list(train_supervisions)
    _check_carvable(remaining, [split for split in ("dev", "test") if not sources[split]], config)
    carved: set[str] = set()
    fractions = {"dev": config.dev_fraction, "test": config.test_fraction}
    for offset, split in enumerate(("dev", "test")):
        if sources[split]:
            continue
        moved = carve_ids(remaining, fractions[split], seed + offset)
        splits[split] = _subset(train_recordings, [s for s in remaining if s.id in moved])
        remaining = [s for s in remaining if s.id not in moved]
        carved.add(split)
    splits["train"] = _subset(train_recordings, remaining)

    rejected = _sorted_rejections(rejected)
    kept = sum(len(supervisions) for _, supervisions in splits.values())
    by_reason = Counter(r.reason for r in rejected)
    cwd = Path.cwd()
    summaries = {}
    for split in SPLITS:
        recordings, supervisions = splits[split]
        summaries[split] = SplitSummary(
            utterances=len(supervisions),
            recordings=len(recordings),
            hours=round(sum(s.duration for s in supervisions) / 3600, 6),
            sampling_rates=sorted({r.sampling_rate for r in recordings}),
            multichannel_recordings=sum(r.num_channels > 1 for r in recordings),
            rejected=sum(r.split == split for r in rejected),
            carved_from_train=split in carved,
        )
    summary = PrepareSummary(
        output_dir=output_dir,
        corpus=config.corpus,
        channel=config.channel,
        splits=summaries,
        total_hours=round(sum(s.hours for s in summaries.values()), 6),
        rejected_by_reason=dict(by_reason),
        rejected_total=len(rejected),
        items_total=kept + len(rejected),
    )
    _log_summary(summary, rejected)

    report = output_dir.with_name(output_dir.name + ".rejected.jsonl")
    if summary.rejected_fraction > config.max_rejected_fraction:
        _write_rejections(report, rejected)
        top = ", ".join(f"{reason}: {count}" for reason, count in by_reason.most_common(3))
        examples = "; ".join(f"{r.split}/{r.id}: {r.detail}" for r in rejected[:2])
        raise AsrflowError(
            f"{summary.rejected_total} of {summary.items_total} items rejected "
            f"({100 * summary.rejected_fraction:.1f}% > max_rejected_fraction "
            f"{100 * config.max_rejected_fraction:.1f}%); top reasons: {top}; e.g. {examples}. "
            f"Every rejected item is listed in {report}: fix the corpus, or raise "
            "prepare.max_rejected_fraction in params.yaml"
        )
    for split in SPLITS:
        if not summaries[split].utterances:
            how = "carving from train left it empty (train too small?)" if split in carved else "no usable items"
            raise AsrflowError(
                f"split {split!r} is empty after preparation ({how}); add data, fix prepare.splits, "
                "or look at the rejected items in the log"
            )

    with atomic_path(output_dir) as tmp:
        tmp.mkdir()
        for split in SPLITS:
            recordings, supervisions = splits[split]
            recordings = RecordingSet.from_recordings(_portable(r, cwd) for r in sorted(recordings, key=lambda r: r.id))
            cuts = CutSet.from_manifests(recordings=recordings, supervisions=supervisions)
            cuts = cuts.trim_to_supervisions(keep_overlapping=False)
            _write_jsonl_gz(tmp / f"{split}_recordings.jsonl.gz", recordings)
            _write_jsonl_gz(tmp / f"{split}_supervisions.jsonl.gz", supervisions)
            _write_jsonl_gz(tmp / f"{split}_cuts.jsonl.gz", sorted(cuts, key=lambda c: c.id))
        _write_rejections(tmp / "rejected.jsonl", rejected)
        (tmp / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2, sort_keys=True) + "\n")
    report.unlink(missing_ok=True)
    logger.info("prepare: manifests written to %s", output_dir)
    return summary
