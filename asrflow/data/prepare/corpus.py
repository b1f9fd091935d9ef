"""The ``prepare`` stage: a corpus -> validated Lhotse manifests for train, dev and test.

:func:`prepare_corpus` reads the corpus (:mod:`asrflow.data.prepare.importers`), checks every
utterance (:mod:`asrflow.data.prepare.validator`, text rules in :mod:`asrflow.data.prepare.text`), and
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
:mod:`asrflow.data.prepare.carving`; the same corpus, params and seed always give the same split.
``test`` may name several test sets, each scored on its own by ``evaluate``
(:meth:`~asrflow.data.prepare.config.PrepareConfig.test_sources`): ``test: [test-clean, test-other]``, or a mapping
``{clean: test-clean, other: test-other}`` to choose their names.

**Duration limits** (``min_duration_s``, ``max_duration_s``, ``long_utterances``) apply to
train only: a corpus' own dev and test are kept as published (comparable with published
WERs); carved splits come from the filtered train. Corrupt audio, empty transcripts and
the other reasons of :mod:`asrflow.data.prepare.rejections` are rejected in every split.

**Streaming.** The corpus is read, checked and written an utterance at a time; the
manifests are sorted by id on disk (:class:`~asrflow.data.prepare.spool.SortedSpool`) inside the
output's temporary folder. What memory holds that grows with the corpus: the ids kept so
far (duplicate check), one count per speaker and per recording (carving), and what an
importer holds (:func:`~asrflow.data.prepare.importers.kaldi.stream_kaldi`).

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

import functools
import itertools
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lhotse.utils import fastcopy

from asrflow.data.manifests import write_test_set_list
from asrflow.data.prepare.carving import GroupCounter, check_carvable, plan_carving
from asrflow.data.prepare.config import OWN_FORMATS, PrepareConfig
from asrflow.data.prepare.importers.common import PROBE_CHUNK, Item, chunked
from asrflow.data.prepare.importers.folder import stream_folder
from asrflow.data.prepare.importers.kaldi import stream_kaldi
from asrflow.data.prepare.importers.recipes import UNSPLIT, cached_recipe, stream_recipe_split
from asrflow.data.prepare.rejections import Rejection
from asrflow.data.prepare.report import PrepareSummary, RejectionLog, SplitSummary, check_rejected, log_summary
from asrflow.data.prepare.split_writer import SplitWriter, cut_dict, portable, recording_dict
from asrflow.data.prepare.spool import DEFAULT_CHUNK_LINES, SortedSpool
from asrflow.data.prepare.supervision_checks import ValidationRules
from asrflow.data.prepare.validator import SplitValidator
from asrflow.errors import AsrflowError
from asrflow.files import atomic_path
from asrflow.logs import progress

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- reading


def recipe_cache_dir(output_dir: Path) -> Path:
    """Where a Lhotse recipe's own manifests are kept between runs: ``<output_dir>.recipe``."""
    return output_dir.with_name(output_dir.name + ".recipe")


def _streams(
    config: PrepareConfig, corpus_dir: Path, sources: dict[str, list[str]], cache_dir: Path
) -> dict[str, list[Callable[[], Iterator[Item]]]]:
    """Our split -> the streams of the corpus' splits it merges (opened when called)."""
    if config.corpus in OWN_FORMATS:
        reader = (
            stream_folder
            if config.corpus == "folder"
            else functools.partial(stream_kaldi, allow_commands=config.allow_commands)
        )
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


def _check_fractions(carved: list[str], config: PrepareConfig) -> None:
    fractions = {"dev": config.dev_fraction, "test": config.test_fraction}
    for split in carved:
        if fractions[split] <= 0:
            raise AsrflowError(
                f"params.yaml: prepare.splits.{split} is null (carve it from train) but "
                f"prepare.{split}_fraction is 0; set it above 0, or name the corpus' {split} split"
            )


# --------------------------------------------------------------------------- entry point


def _validate_into_spool(
    split: str,
    streams: list[Callable[[], Iterator[Item]]],
    *,
    validator: SplitValidator,
    spool: SortedSpool,
    rejections: RejectionLog,
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
    (:mod:`asrflow.data.prepare.carving`); the manifests are sorted on disk
    (:class:`~asrflow.data.prepare.spool.SortedSpool`) inside the output's temporary folder.

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
    written = list(dict.fromkeys(corpus.target(split) for corpus in corpora for split in corpus.sources))
    carved_into = {corpus.target(split) for corpus in corpora for split in corpus.carved}
    report = output_dir.with_name(output_dir.name + ".rejected.jsonl")
    with atomic_path(output_dir) as tmp:
        tmp.mkdir()
        work = tmp / ".work"
        work.mkdir()
        rejections = RejectionLog(tmp / "rejected.jsonl")
        streamed = list(dict.fromkeys(corpus.target(split) for corpus in corpora for split in corpus.streams))
        spools = {
            target: SortedSpool(work, f"{index}_cuts", chunk_lines=chunk_lines) for index, target in enumerate(streamed)
        }
        kept = _read_corpora(corpora, spools, rejections, report)
        rejections.close()
        _plan_carving(corpora, seed)
        writers = {split: SplitWriter(tmp, split, work, chunk_lines=chunk_lines) for split in written}
        _write_splits(corpora, spools, writers)
        work.rmdir()
        summary = _summarise(
            config, output_dir, corpora, writers=writers, rejections=rejections, kept=kept, carved_into=carved_into
        )
        log_summary(summary, rejections)
        _check_not_empty(summary, written, carved_into)
        tests = [split for split in written if split not in ("train", "dev")]
        write_test_set_list(tmp, tests, [corpus.name for corpus in corpora if corpus.name])
        (tmp / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2, sort_keys=True) + "\n")
    report.unlink(missing_ok=True)
    logger.info("prepare: manifests written to %s", output_dir)
    return summary


def _read_corpora(
    corpora: list[_Corpus], spools: dict[str, SortedSpool], rejections: RejectionLog, report: Path
) -> int:
    """Read and check every corpus' splits into the spools of the splits they go to; returns the
    utterances kept in all. A corpus with too many rejected items stops it (:func:`check_rejected`)."""
    cwd = Path.cwd()
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
        check_rejected(rejections, kept=kept, rejected=rejected, config=corpus.config, report=report)
        kept_in_all += kept
    return kept_in_all


def _plan_carving(corpora: list[_Corpus], seed: int) -> None:
    """Decide, for each corpus, which of its train utterances go to the splits it carves (``corpus.plan``)."""
    for corpus in corpora:
        check_carvable(corpus.counter, corpus.carved, corpus.name)
        fractions = {"dev": corpus.config.dev_fraction, "test": corpus.config.test_fraction}
        corpus.plan = plan_carving(corpus.counter, {split: fractions[split] for split in corpus.carved}, seed)


def _write_splits(corpora: list[_Corpus], spools: dict[str, SortedSpool], writers: dict[str, SplitWriter]) -> None:
    """Drain the spools into the split writers (sorted by id), moving carved utterances out of
    train, and close the writers."""
    by_name = {corpus.name: corpus for corpus in corpora}
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


def _summarise(
    config: PrepareConfig,
    output_dir: Path,
    corpora: list[_Corpus],
    *,
    writers: dict[str, SplitWriter],
    rejections: RejectionLog,
    kept: int,
    carved_into: set[str],
) -> PrepareSummary:
    """The summary of what the writers wrote and the rejections, per split we write."""
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
    return PrepareSummary(
        output_dir=output_dir,
        corpus=", ".join(f"{c.name}: {c.config.corpus}" if c.name else c.config.corpus for c in corpora),
        channel=config.channel,
        splits=summaries,
        total_hours=round(sum(s.hours for s in summaries.values()), 6),
        rejected_by_reason=dict(rejections.by_reason),
        rejected_total=rejections.total,
        items_total=kept + rejections.total,
    )


def _check_not_empty(summary: PrepareSummary, written: list[str], carved_into: set[str]) -> None:
    """Refuse to write a split that holds no utterance."""
    for split in written:
        if not summary.splits[split].utterances:
            how = "carving from train left it empty (train too small?)" if split in carved_into else "no usable items"
            raise AsrflowError(
                f"split {split!r} is empty after preparation ({how}); add data, fix prepare.splits, "
                "or look at the rejected items in the log"
            )
