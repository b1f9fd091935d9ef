"""``asrflow corpus PATH``: what a corpus holds and what prepare would make of it, without writing anything.

The corpus is read by prepare's own importers (:func:`~asrflow.data.prepare.importers.folder.stream_folder`,
:func:`~asrflow.data.prepare.importers.kaldi.stream_kaldi`, a Lhotse recipe through
:func:`~asrflow.data.prepare.importers.recipes.run_recipe`) and every item goes through prepare's own validator
(:class:`~asrflow.data.prepare.validator.SplitValidator`) with the rules of ``params.yaml``'s ``prepare``
section: what the report calls rejected is what prepare would reject, for the same reason (one rule). No
manifest is written: kept items are counted and dropped.

**Streaming.** The folder and Kaldi formats stream an item at a time: memory holds counters, a fixed-bin
duration histogram, at most :data:`EXAMPLES_PER_REASON` examples per reason, at most :data:`ODD_WORDS_TRACKED`
out-of-place words, and what prepare itself holds (the ids kept so far, for its duplicate check). A Lhotse
recipe's manifests are held whole, as ``run_recipe`` returns them.

**Out-of-place words** (one simple rule): a word of a kept transcript, after prepare's text normalisation,
that holds a digit or a character that is neither a letter nor an apostrophe.

**Exit codes:** 0 when something is usable (the problems are reported), :data:`EXIT_NOTHING_USABLE` when
nothing is (an empty folder, no transcripts, every train item rejected), 2 for a wrong PATH or params file.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asrflow.data.prepare.config import PrepareConfig
from asrflow.data.prepare.importers.common import PROBE_CHUNK, Item, chunked
from asrflow.data.prepare.rejections import Rejection
from asrflow.data.prepare.supervision_checks import ValidationRules
from asrflow.data.prepare.validator import Candidate, SplitValidator
from asrflow.errors import AsrflowError

#: Exit code of ``asrflow corpus`` when nothing in the corpus is usable.
EXIT_NOTHING_USABLE = 3
#: Upper edges (seconds) of the duration histogram's bins; the last bin holds everything longer.
DURATION_BINS_S = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0)
#: Examples kept per rejection reason.
EXAMPLES_PER_REASON = 3
#: Distinct out-of-place words counted (later new ones are not tracked).
ODD_WORDS_TRACKED = 10_000
#: Recent recording ids remembered, so that the segments of one recording count its rate and channels once.
RECENT_RECORDINGS = 1024
#: Size classes: name, upper bound in hours, the preset file for it (under the params file's folder).
SIZE_CLASSES = (
    ("small (under 10 h)", 10.0, "presets/small-corpus.yaml"),
    ("medium (10-300 h)", 300.0, "presets/real-corpus.yaml"),
    ("large (over 300 h)", math.inf, "presets/large-corpus.yaml"),
)
#: Highest rate suggested for ``features.sampling_rate``: speech above 8 kHz adds little.
MAX_SUGGESTED_RATE = 16000
#: File name endings counted as audio when a folder holds no transcripts.
AUDIO_SUFFIXES = frozenset({".wav", ".flac", ".ogg", ".mp3", ".opus", ".sph", ".m4a", ".aac"})
#: What to do about each rejection reason: the setting that handles it, or the fix.
REASON_FIXES = {
    "malformed_line": "fix the line: path<TAB>transcript[<TAB>speaker] (folder), '<id> <text>' (kaldi)",
    "non_utf8_text": "save the transcript file as UTF-8",
    "duplicate_id": "give each utterance its own id (the first valid copy is kept)",
    "piped_command": "prepare.allow_commands: true runs wav.scp commands, or convert the audio to files",
    "command_failed": "fix the wav.scp command or drop its line",
    "path_outside_corpus": "move the audio under the corpus folder",
    "missing_audio": "restore the audio file or drop its line",
    "missing_recording": "add the recording to wav.scp or drop the utterance",
    "missing_transcript": "add the utterance to text or drop its segment",
    "unreadable_audio": "re-encode or replace the file",
    "zero_length_audio": "remove the file or its line",
    "bad_segment": "fix the segment times",
    "channel_out_of_range": "prepare.channel: mix (average the channels) or an index that exists",
    "too_short": "prepare.min_duration_s (train only)",
    "too_long": "prepare.max_duration_s, or prepare.long_utterances: split (train only)",
    "too_long_no_alignment": "prepare.max_duration_s, or word alignments for long_utterances: split",
    "empty_transcript": "write the transcript (prepare.text.whitelist / strip_punctuation can empty one)",
    "invalid_manifest": "re-encode the file",
}


@dataclass
class CorpusLayout:
    """Where and how a corpus is read: its format (``folder``, ``kaldi`` or a Lhotse recipe's name), its
    folder, and its split names (TSV stems, Kaldi folders; a recipe's are known once it has run)."""

    corpus: str
    corpus_dir: Path
    split_names: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class CorpusTally:
    """The counters of a corpus report; every field is bounded but ``kept_ids`` (prepare's duplicate check)."""

    items: int = 0
    kept: int = 0
    kept_seconds: float = 0.0
    durations: Counter = field(default_factory=Counter)
    rates: Counter = field(default_factory=Counter)
    channels: Counter = field(default_factory=Counter)
    characters: Counter = field(default_factory=Counter)
    odd_words: Counter = field(default_factory=Counter)
    rejected: Counter = field(default_factory=Counter)
    examples: dict[str, list[Rejection]] = field(default_factory=dict)
    per_split: dict[str, Counter] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    kept_ids: set[str] = field(default_factory=set)
    recent: OrderedDict = field(default_factory=OrderedDict)

    def reject(self, rejection: Rejection, split: str) -> None:
        self.items += 1
        self.rejected[rejection.reason] += 1
        self.per_split.setdefault(split, Counter())["rejected"] += 1
        examples = self.examples.setdefault(rejection.reason, [])
        if len(examples) < EXAMPLES_PER_REASON:
            examples.append(rejection)

    def keep(self, pieces: list, recording: Any, split: str) -> None:
        self.items += 1
        self.per_split.setdefault(split, Counter())["kept"] += 1
        for piece in pieces:
            self.kept += 1
            self.kept_seconds += piece.duration
            self.durations[duration_bin(piece.duration)] += 1
            for word in (piece.text or "").split():
                self.characters.update(word)
                if is_out_of_place(word) and (word in self.odd_words or len(self.odd_words) < ODD_WORDS_TRACKED):
                    self.odd_words[word] += 1
        if recording.id not in self.recent:
            self.rates[recording.sampling_rate] += 1
            self.channels[recording.num_channels] += 1
        self.recent[recording.id] = None
        self.recent.move_to_end(recording.id)
        if len(self.recent) > RECENT_RECORDINGS:
            self.recent.popitem(last=False)


def duration_bin(seconds: float) -> int:
    """The index of the :data:`DURATION_BINS_S` bin ``seconds`` falls in."""
    for index, edge in enumerate(DURATION_BINS_S):
        if seconds < edge:
            return index
    return len(DURATION_BINS_S)


def is_out_of_place(word: str) -> bool:
    """The rule of the module docstring: a digit, or a character neither a letter nor an apostrophe."""
    return any(not (char.isalpha() or char == "'") for char in word)


# --------------------------------------------------------------------------- finding the corpus


def find_layout(path: Path, corpus_format: str, recipe: str | None) -> CorpusLayout:
    """How to read ``path``: ``corpus_format`` ``auto`` takes ``folder`` when it holds ``*.tsv`` files,
    ``kaldi`` when a sub-folder holds ``wav.scp``, else ``folder``; ``recipe`` takes ``recipe``'s name.

    Raises:
        AsrflowError: ``path`` is not a folder, or ``--format recipe`` without a recipe name.
    """
    if not path.is_dir():
        raise AsrflowError(f"{path} is not a folder; give the folder that holds the corpus")
    tsvs = sorted(p.stem for p in path.glob("*.tsv") if p.is_file())
    kaldi = sorted(p.name for p in path.iterdir() if (p / "wav.scp").is_file())
    if corpus_format == "recipe" or (corpus_format == "auto" and recipe):
        if not recipe:
            raise AsrflowError("--format recipe needs --recipe NAME (a Lhotse recipe, e.g. librispeech)")
        return CorpusLayout(recipe, path)
    if corpus_format == "kaldi" or (corpus_format == "auto" and kaldi and not tsvs):
        return CorpusLayout("kaldi", path, kaldi)
    return CorpusLayout("folder", path, tsvs)


def suggested_splits(names: list[str]) -> dict[str, Any]:
    """``prepare.splits`` for split names found: ``train`` (the one named so, else one starting with it, else
    the first), ``dev`` (dev / valid*), ``test`` (test*, a list when several); a missing one is carved (null)."""
    if not names:
        return {"train": None, "dev": None, "test": None}
    train = next((n for n in names if n == "train"), None) or next((n for n in names if "train" in n), names[0])
    rest = [n for n in names if n != train]
    dev = next((n for n in rest if n.startswith(("dev", "valid"))), None)
    tests = [n for n in rest if n.startswith(("test", "eval"))]
    return {"train": train, "dev": dev, "test": tests[0] if len(tests) == 1 else (tests or None)}


def _split_of(splits: dict[str, Any]) -> dict[str, str]:
    """Corpus split name -> our split, for the names ``splits`` uses."""
    ours: dict[str, str] = {}
    for split, value in splits.items():
        for name in [value] if isinstance(value, str) else value or []:
            ours[name] = split
    return ours


# --------------------------------------------------------------------------- reading


def _rules(config: PrepareConfig) -> ValidationRules:
    return ValidationRules(
        min_duration_s=config.min_duration_s,
        max_duration_s=config.max_duration_s,
        long_utterances=config.long_utterances,
        channel=config.channel,
        text=config.text,
    )


def _streams(layout: CorpusLayout, config: PrepareConfig) -> dict[str, Callable[[], Iterator[Item]]]:
    """Corpus split name -> a function that opens its stream (prepare's importer for the format)."""
    if layout.corpus == "folder":
        from asrflow.data.prepare.importers.folder import stream_folder

        return {name: (lambda n=name: stream_folder(layout.corpus_dir, n, n)) for name in layout.split_names}
    if layout.corpus == "kaldi":
        from asrflow.data.prepare.importers.kaldi import stream_kaldi

        return {
            name: (lambda n=name: stream_kaldi(layout.corpus_dir, n, n, allow_commands=config.allow_commands))
            for name in layout.split_names
        }
    from asrflow.data.prepare.importers.recipes import run_recipe

    imported = run_recipe(layout.corpus, layout.corpus_dir, dict(config.recipe_args))
    layout.split_names = sorted(imported)
    return {name: (lambda part=part: _recipe_items(part)) for name, part in imported.items()}


def _recipe_items(part: Any) -> Iterator[Item]:
    """One recipe split's candidates, as :func:`~asrflow.data.prepare.validator.validate_split` builds them."""
    by_id = {recording.id: recording for recording in part.recordings}
    channels: dict[str, set] = {}
    for supervision in part.supervisions:
        channel = supervision.channel
        channels.setdefault(supervision.recording_id, set()).add(
            tuple(channel) if isinstance(channel, list) else channel
        )
    for supervision in part.supervisions:
        yield Candidate(
            supervision=supervision,
            recording=by_id.get(supervision.recording_id),
            per_channel=len(channels[supervision.recording_id]) > 1,
        )


def read_corpus(layout: CorpusLayout, config: PrepareConfig) -> tuple[CorpusTally, dict[str, Any]]:
    """Read and check every split of the corpus as prepare would; the tally and the suggested ``prepare.splits``.

    Raises:
        AsrflowError: a recipe that fails (as prepare would).
    """
    tally = CorpusTally()
    streams = _streams(layout, config)
    splits = suggested_splits(layout.split_names)
    ours = _split_of(splits)
    rules = _rules(config)
    for name, opener in streams.items():
        split = ours.get(name)
        if split is None:
            tally.problems.append(
                f"split {name!r} is not used by the suggested prepare.splits; name it there to use it"
            )
        validator = SplitValidator(name, rules, tally.kept_ids, duration_limits=split == "train")
        try:
            _tally_split(tally, opener(), validator, name)
        except AsrflowError as error:
            tally.problems.append(f"split {name!r} cannot be read: {error}")
    return tally, splits


def _tally_split(tally: CorpusTally, items: Iterator[Item], validator: SplitValidator, split: str) -> None:
    for chunk in chunked(items, PROBE_CHUNK):
        candidates = []
        for item in chunk:
            if isinstance(item, Rejection):
                tally.reject(item, split)
            else:
                candidates.append(item)
        for outcome in validator.check(candidates):
            if isinstance(outcome, Rejection):
                tally.reject(outcome, split)
            else:
                tally.keep(outcome.pieces, outcome.recording, split)


def count_audio_files(folder: Path, limit: int = 1_000_000) -> int:
    """Audio files (by :data:`AUDIO_SUFFIXES`) under ``folder``, counted up to ``limit``."""
    found = 0
    for _, _, files in os.walk(folder):
        found += sum(1 for name in files if Path(name).suffix.lower() in AUDIO_SUFFIXES)
        if found >= limit:
            break
    return found


# --------------------------------------------------------------------------- suggestions


def suggested_rate(rates: Counter) -> int | None:
    """``features.sampling_rate``: the most common rate, at most :data:`MAX_SUGGESTED_RATE`."""
    if not rates:
        return None
    return min(rates.most_common(1)[0][0], MAX_SUGGESTED_RATE)


def size_class(hours: float, root: Path) -> tuple[str, Path | None]:
    """The size class of ``hours`` and its preset file under ``root`` (``None`` when there is none yet)."""
    for name, upper, preset in SIZE_CLASSES:
        if hours < upper:
            return name, (root / preset if (root / preset).is_file() else None)
    raise AssertionError("the last size class has no upper bound")


def machine_presets(root: Path) -> list[Path]:
    """The tuner's presets (``asrflow tune`` writes ``presets/machine-<cpu or gpu>.yaml``) under ``root``."""
    return sorted((root / "presets").glob("machine-*.yaml"))


def suggested_overrides(layout: CorpusLayout, splits: dict[str, Any], tally: CorpusTally, root: Path) -> dict[str, Any]:
    """The params.yaml overrides the report suggests: the ``prepare`` corpus keys and ``features.sampling_rate``.
    ``corpus_dir`` is relative to ``root`` (the params file's folder, where the stages run) when it lies inside."""
    corpus_dir = layout.corpus_dir.resolve()
    root = root.resolve()
    where = corpus_dir.relative_to(root).as_posix() if corpus_dir.is_relative_to(root) else str(corpus_dir)
    overrides: dict[str, Any] = {"prepare": {"corpus": layout.corpus, "corpus_dir": where, "splits": splits}}
    rate = suggested_rate(tally.rates)
    if rate is not None:
        overrides["features"] = {"sampling_rate": rate}
    return overrides


def write_overrides(overrides: dict[str, Any], params_path: Path) -> list[str]:
    """Apply ``overrides`` to ``params_path`` as a preset would (:func:`asrflow.presets.apply_preset`: comments
    and order kept); the dotted keys it changed. The preset goes through a temporary file outside the corpus."""
    import yaml

    from asrflow.presets import apply_preset

    with tempfile.TemporaryDirectory(prefix="asrflow-corpus-") as scratch:
        preset = Path(scratch) / "corpus.yaml"
        preset.write_text(yaml.safe_dump(overrides, sort_keys=False, default_flow_style=None))
        return apply_preset(preset, params_path)


# --------------------------------------------------------------------------- the report

#: Width of the histogram's longest bar, in characters.
BAR_WIDTH = 40


def _bin_label(index: int) -> str:
    low = 0.0 if index == 0 else DURATION_BINS_S[index - 1]
    if index == len(DURATION_BINS_S):
        return f"{low:g}+ s"
    return f"{low:g}-{DURATION_BINS_S[index]:g} s"


def histogram_lines(durations: Counter) -> list[str]:
    """The duration histogram: one line per fixed bin, a text bar scaled to the fullest bin."""
    top = max(durations.values(), default=0)
    lines = []
    for index in range(len(DURATION_BINS_S) + 1):
        count = durations.get(index, 0)
        bar = "#" * (math.ceil(BAR_WIDTH * count / top) if top and count else 0)
        lines.append(f"    {_bin_label(index):>9} | {bar:<{BAR_WIDTH}} {count}")
    return lines


def _counts(counter: Counter, unit: str = "") -> str:
    return ", ".join(f"{key}{unit}: {count}" for key, count in sorted(counter.items())) or "none"


def _text_lines(tally: CorpusTally) -> list[str]:
    chars = "".join(sorted(tally.characters))
    odd_chars = sorted(c for c in tally.characters if not (c.isalpha() or c == "'"))
    lines = [f"  characters ({len(tally.characters)}): {chars or 'none'}"]
    if odd_chars:
        lines.append(
            "  characters neither letters nor ': " + ", ".join(f"{c!r} x{tally.characters[c]}" for c in odd_chars)
        )
    odd = tally.odd_words.most_common(10)
    more = f" (and {len(tally.odd_words) - len(odd)} more)" if len(tally.odd_words) > len(odd) else ""
    words = ", ".join(f"{word} x{count}" for word, count in odd)
    lines.append(f"  out-of-place words (a digit, or a character not a letter nor '): {words or 'none'}{more}")
    return lines


def _rejection_lines(tally: CorpusTally) -> list[str]:
    total = sum(tally.rejected.values())
    if not total:
        return ["  none"]
    lines = []
    for reason, count in tally.rejected.most_common():
        lines.append(f"  {reason}: {count}  -> {REASON_FIXES.get(reason, 'see asrflow.data.prepare.rejections')}")
        for example in tally.examples.get(reason, []):
            lines.append(f"      {example.split}/{example.id}: {example.detail}")
    return lines


def problem_lines(layout: CorpusLayout, tally: CorpusTally, config: PrepareConfig) -> list[str]:
    """Each problem found, with the setting that handles it (or the fix)."""
    problems = list(tally.problems)
    if not layout.split_names:
        problems.append(_nothing_found(layout))
    if len(tally.rates) > 1:
        rate = suggested_rate(tally.rates)
        problems.append(
            f"mixed sampling rates ({_counts(tally.rates, ' Hz')} recordings): prepare keeps each as it is and "
            f"features.sampling_rate (suggested: {rate}) resamples every recording to one rate"
        )
    multi = {channels: count for channels, count in tally.channels.items() if channels > 1}
    if multi:
        problems.append(
            f"multi-channel audio ({_counts(Counter(multi), ' channels')} recordings): prepare.channel = "
            f"{config.channel!r} ({'averages the channels' if config.channel == 'mix' else 'keeps that channel'}); "
            "set it to mix to average them or to an index (0, 1, ...) to keep one"
        )
    rejected = sum(tally.rejected.values())
    if tally.items and rejected / tally.items > config.max_rejected_fraction:
        problems.append(
            f"prepare would stop: {rejected} of {tally.items} items rejected ({rejected / tally.items:.1%}) > "
            f"prepare.max_rejected_fraction = {config.max_rejected_fraction}; fix the items above or raise it"
        )
    if layout.split_names and not tally.per_split.get(_train_name(layout), Counter())["kept"]:
        problems.append("nothing usable: no train item passes prepare's checks (see the rejected items)")
    return [f"  - {problem}" for problem in problems] or ["  none"]


def _train_name(layout: CorpusLayout) -> str | None:
    return suggested_splits(layout.split_names)["train"]


def _nothing_found(layout: CorpusLayout) -> str:
    if not any(layout.corpus_dir.iterdir()):
        return f"nothing usable: {layout.corpus_dir} is empty"
    audio = count_audio_files(layout.corpus_dir)
    if layout.corpus == "kaldi":
        want = "a folder per split holding wav.scp and text (kaldi)"
    elif layout.corpus == "folder":
        want = "a transcript file per split, <split>.tsv: relative/path.wav<TAB>transcript (folder)"
    else:
        want = f"what lhotse's prepare_{layout.corpus} expects"
    return f"nothing usable: no transcripts; {layout.corpus_dir} holds {audio} audio file(s) but not {want}"


def suggestion_lines(overrides: dict[str, Any], hours: float, root: Path) -> list[str]:
    """The suggested params, the size class and its preset, and the machine's preset."""
    prepare = overrides["prepare"]
    splits = ", ".join(f"{key}: {_yaml_value(value)}" for key, value in prepare["splits"].items())
    lines = [
        f"  prepare.corpus: {prepare['corpus']}",
        f"  prepare.corpus_dir: {prepare['corpus_dir']}",
        f"  prepare.splits: {{{splits}}}   (null: carved from train)",
    ]
    if "features" in overrides:
        lines.append(f"  features.sampling_rate: {overrides['features']['sampling_rate']}")
    name, preset = size_class(hours, root)
    lines.append(
        f"  size: {name}: "
        + (f"preset {preset} (asrflow preset {preset})" if preset else "no preset for this size yet")
    )
    machines = machine_presets(root)
    lines.append(
        "  machine: " + ", ".join(f"asrflow preset {path}" for path in machines)
        if machines
        else "  machine: no tuner preset yet (asrflow tune measures this machine and writes presets/machine-*.yaml)"
    )
    return lines


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    return f"[{', '.join(value)}]" if isinstance(value, list) else str(value)


def report_lines(
    layout: CorpusLayout, tally: CorpusTally, *, config: PrepareConfig, overrides: dict[str, Any], root: Path
) -> list[str]:
    """The whole report, as printed by ``asrflow corpus``."""
    hours = tally.kept_seconds / 3600
    per_split = ", ".join(f"{name}: {c['kept']} kept, {c['rejected']} rejected" for name, c in tally.per_split.items())
    return [
        f"corpus {layout.corpus_dir} ({layout.corpus}; splits: {', '.join(layout.split_names) or 'none found'})",
        f"  items: {tally.items} read, {tally.kept} usable, {sum(tally.rejected.values())} rejected",
        f"  per split: {per_split or 'none'}",
        f"  hours (usable): {hours:.3f}",
        "  durations:",
        *histogram_lines(tally.durations),
        f"  sampling rates (recordings): {_counts(tally.rates, ' Hz')}",
        f"  channels (recordings): {_counts(tally.channels)}",
        *_text_lines(tally),
        "rejected by prepare (reason: count -> what handles it; examples):",
        *_rejection_lines(tally),
        "problems:",
        *problem_lines(layout, tally, config),
        "suggested params (--write applies the prepare and features keys to the params file):",
        *suggestion_lines(overrides, hours, root),
    ]


def _prepare_config(params_path: Path, corpus: str) -> PrepareConfig:
    """The checks' settings from the params file's ``prepare`` section (prepare's defaults without one);
    ``recipe_args`` only when the section names the same corpus."""
    from asrflow.params import load_params

    if not params_path.is_file():
        return PrepareConfig()
    section = dict(load_params(params_path).get("prepare") or {})
    config = PrepareConfig.from_section(section)
    if config.corpus != corpus:
        config = PrepareConfig.from_section({**section, "recipe_args": {}})
    return config


def inspect_corpus(path: Path, *, corpus_format: str, recipe: str | None, params: Path, write: bool) -> int:
    """``asrflow corpus``: print the report of ``path``; with ``write``, apply the suggestions to ``params``.
    Returns the exit code (0, or :data:`EXIT_NOTHING_USABLE`).

    Raises:
        AsrflowError: a wrong path or params file, a failing recipe.
    """
    layout = find_layout(path, corpus_format, recipe)
    config = _prepare_config(params, layout.corpus)
    tally, splits = read_corpus(layout, config)
    root = params.resolve().parent
    overrides = suggested_overrides(layout, splits, tally, root)
    print("\n".join(report_lines(layout, tally, config=config, overrides=overrides, root=root)))
    usable = bool(layout.split_names) and tally.per_split.get(_train_name(layout), Counter())["kept"] > 0
    if not usable:
        print(f"nothing usable in {path}; exit status {EXIT_NOTHING_USABLE}")
        return EXIT_NOTHING_USABLE
    if write:
        if not params.is_file():
            raise AsrflowError(f"--write: {params} not found; give the params file with --params")
        changed = write_overrides(overrides, params)
        print(f"{params}: {len(changed)} key(s) changed: {', '.join(changed) or 'none'}")
    return 0
