"""A spoken corpus of any size, synthesized on the machine with espeak-ng, for scale and robustness figures.

Speech synthesized by espeak-ng is not speech people make: a model's error rate on it says
nothing about a real corpus. This corpus exists to measure how the pipeline's time and memory
grow with the amount of audio, and to exercise the stages on many files and voices; never
quote it as a substitute for a real-corpus claim.

Each utterance is a sentence of ``min_words``-``max_words`` words drawn from a word list
(by default ``words.txt`` beside this module: 4,000 words of Debian's ``wamerican``, see
``words.NOTICE``), or with ``--text sentences`` a real English sentence of Debian's ``fortunes``
package (:mod:`asrflow.generate.sentences`, ``sentences.NOTICE``), spoken by one of ``voices`` voices.
A voice is an espeak-ng English dialect
(``en-us``, ``en-gb-scotland``...), a voice variant (``m3``, ``f2``, ``klatt``...), a speed
(words per minute) and a pitch (0-99). Audio is resampled from espeak-ng's 22,050 Hz to
16 kHz and written as 16-bit FLAC. Transcripts are the words exactly as spoken (lowercase).

Layout (``corpus: folder``, see :mod:`asrflow.data.prepare.importers.folder`)::

    OUT/train.tsv, dev.tsv, test.tsv   audio/<split>/<voice>/<index>.flac <TAB> words <TAB> voice
    OUT/audio/<split>/<voice>/<index>.flac
    OUT/corpus.json                    seed, sizes, voices and their splits (written last)

Splits are by voice: about 5 % of the voices (at least one) speak only dev, as many only test,
the rest train. With sentences they are by sentence too: each dev and test sentence is spoken once,
by a voice of its split, and never in train; a train sentence is spoken at most ``--max-repeats``
times (by the voices its utterances draw). A size the text source cannot reach so is refused,
naming how many sentences it holds and how many the size needs.
Everything is a function of the seed and the options: the same call writes the
same transcripts and the same audio. The folder appears whole (built beside it, then renamed).

Command line::

    python -m asrflow.generate.spoken_corpus --hours 5 --out data/corpora/spoken-5h --seed 0
    python -m asrflow.generate.spoken_corpus --hours 10 --text sentences --out data/corpora/sentences-10h --seed 0

(``--hours 25`` and ``--hours 50`` the same way; ``--text sentences`` needs
``apt-get install fortunes fortunes-min``.)

Synthesis runs in one process per core (``--jobs``); espeak-ng must be on the PATH
(Debian/Ubuntu: ``apt-get install espeak-ng``).
"""

from __future__ import annotations

import argparse
import functools
import io
import itertools
import json
import math
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from asrflow.errors import AsrflowError, exit_on_user_error, require_extra
from asrflow.generate import sentences as sentence_source

ESPEAK = "espeak-ng"
#: espeak-ng's English dialects (its ``gmw`` voices).
DIALECTS = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan", "en-gb-x-gbcwmd", "en-029", "en-us-nyc")
#: espeak-ng voice variants that sound like a person (its robotic, whispering and demonic ones left out).
VARIANTS = (
    *(f"m{i}" for i in range(1, 9)),
    *(f"f{i}" for i in range(1, 6)),
    *("croak", "klatt", "klatt2", "klatt3", "klatt4", "adam", "Alex", "Alicia", "Andrea", "Andy", "Annie"),
    *("antonio", "aunty", "belinda", "benjamin", "boris", "caleb", "david", "Denis", "ed", "edward", "gustave"),
    *("Henrique", "Hugo", "iven", "Jacky", "john", "Lee", "linda", "max", "Michael", "Mike", "Nguyen", "pablo"),
    *("paul", "pedro", "quincy", "rob", "robert", "steph", "travis", "victor", "zac", "anika", "grandpa"),
    *("grandma", "norbert", "sandro", "shelby"),
)
SPEED_WPM = (125, 195)
PITCH = (20, 80)
ESPEAK_RATE = 22050
SAMPLING_RATE = 16000
#: Share of the voices that speak only dev, and only test (at least one voice each).
HELD_OUT_FRACTION = 0.05
SPLITS = ("train", "dev", "test")
WORDS = Path(__file__).with_name("words.txt")
#: ``--text``: random words of the word list, or real sentences (Debian's fortunes; or give a file or folder).
TEXTS = ("words", "sentences")
#: Most times one train sentence is spoken (each time by the voice its utterance draws); dev and test
#: sentences are spoken once each, and never in train.
MAX_REPEATS = 5
#: Seconds a spoken word takes, as a share of ``60 / speed_wpm``, for estimating how many sentences some hours
#: need: espeak-ng's words, pauses included, take a little more than this, so the estimate errs towards more
#: utterances than the hours take (and so towards more dev and test sentences kept apart).
SPOKEN_WORD_SHARE = 0.8
INFO_FILE = "corpus.json"


@dataclass(frozen=True)
class Voice:
    """One speaker: an espeak-ng dialect and variant at a speed (words per minute) and a pitch (0-99)."""

    dialect: str
    variant: str
    speed_wpm: int
    pitch: int

    @property
    def name(self) -> str:
        """A name fit for a folder and a speaker id, e.g. ``en-gb-scotland_m3_s150_p40``."""
        return f"{self.dialect}_{self.variant}_s{self.speed_wpm}_p{self.pitch}"

    def espeak_args(self) -> list[str]:
        return ["-v", f"{self.dialect}+{self.variant}", "-s", str(self.speed_wpm), "-p", str(self.pitch)]


@dataclass(frozen=True)
class Utterance:
    """Utterance ``index``: ``words`` spoken by ``voice``, in ``split``; ``path`` is relative to the corpus."""

    index: int
    voice: Voice
    split: str
    words: tuple[str, ...]

    @property
    def path(self) -> str:
        return f"audio/{self.split}/{self.voice.name}/{self.index:07d}.flac"

    @property
    def text(self) -> str:
        return " ".join(self.words)


def espeak_missing() -> str | None:
    """Why espeak-ng cannot synthesize here (``None`` when it can)."""
    if shutil.which(ESPEAK) is None:
        return f"{ESPEAK} is not on the PATH (Debian/Ubuntu: apt-get install espeak-ng)"
    try:
        subprocess.run([ESPEAK, "-v", "en-us", "--stdout", "ok"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        return f"{ESPEAK} does not run: {error}"
    return None


def load_words(path: Path | None = None) -> list[str]:
    """The word list: one word a line, blank lines and duplicates dropped, in file order."""
    path = path or WORDS
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise AsrflowError(f"word list {path}: {error}; give a UTF-8 text file with one word a line") from None
    words = list(dict.fromkeys(word.strip() for word in text.splitlines() if word.strip()))
    if not words:
        raise AsrflowError(f"word list {path} holds no words; give a text file with one word a line")
    return words


def make_voices(count: int, seed: int) -> list[Voice]:
    """``count`` distinct voices: dialect x variant pairs in a seeded order (repeated past 448), each
    with its own speed and pitch."""
    if count < len(SPLITS):
        raise AsrflowError(f"voices: {count} is too few; give at least {len(SPLITS)} (one per split)")
    rng = random.Random(f"voices-{seed}")
    pairs = list(itertools.product(DIALECTS, VARIANTS))
    rng.shuffle(pairs)
    voices: dict[str, Voice] = {}
    for dialect, variant in itertools.islice(itertools.cycle(pairs), count * 4):
        voice = Voice(dialect, variant, rng.randint(*SPEED_WPM), rng.randint(*PITCH))
        voices.setdefault(voice.name, voice)
        if len(voices) == count:
            return list(voices.values())
    raise AsrflowError(f"voices: could not draw {count} distinct voices; ask for fewer")


def split_of_voices(voices: list[Voice], seed: int) -> dict[str, str]:
    """Voice name -> split: :data:`HELD_OUT_FRACTION` of the voices (at least one) each for dev and test."""
    names = [voice.name for voice in voices]
    random.Random(f"splits-{seed}").shuffle(names)
    held_out = max(1, round(HELD_OUT_FRACTION * len(names)))
    return {name: "dev" if i < held_out else "test" if i < 2 * held_out else "train" for i, name in enumerate(names)}


def plan_utterance(
    index: int, *, seed: int, voices: list[Voice], splits: dict[str, str], words: list[str], word_range: tuple[int, int]
) -> Utterance:
    """Utterance ``index`` of the corpus of ``seed``: its voice and words depend on nothing else."""
    rng = random.Random(f"utterance-{seed}-{index}")
    voice = voices[rng.randrange(len(voices))]
    sentence = tuple(rng.choice(words) for _ in range(rng.randint(*word_range)))
    return Utterance(index, voice, splits[voice.name], sentence)


def _voice_of(index: int, seed: int, voices: list[Voice]) -> Voice:
    """The voice of utterance ``index`` of the corpus of ``seed`` (drawn as :func:`plan_utterance` draws it)."""
    return voices[random.Random(f"utterance-{seed}-{index}").randrange(len(voices))]


def sentence_pools(
    found: list[str], *, seed: int, voices: list[Voice], splits: dict[str, str], size: dict, max_repeats: int
) -> dict[str, list[str]]:
    """Split ``found`` sentences into disjoint train, dev and test pools, enough for ``size`` (``hours`` or
    ``utterances``): dev and test get one sentence for each of their utterances (estimated for hours, see
    :data:`SPOKEN_WORD_SHARE`), train the rest, to be spoken at most ``max_repeats`` times each.

    Raises:
        AsrflowError: too few sentences for the size without repeating dev or test sentences (or a train
            sentence more than ``max_repeats`` times), naming how many were found and how many are needed.
    """
    count = size["utterances"]
    if count is None:
        mean_words = sum(len(sentence.split()) for sentence in found) / max(1, len(found))
        word_s = SPOKEN_WORD_SHARE * sum(60 / voice.speed_wpm for voice in voices) / len(voices)
        count = math.ceil(size["hours"] * 3600 / max(mean_words * word_s, 1e-9))
    needs = dict.fromkeys(SPLITS, 0)
    for index in range(count):
        needs[splits[_voice_of(index, seed, voices).name]] += 1
    needed = needs["dev"] + needs["test"] + math.ceil(needs["train"] / max_repeats)
    if needed > len(found):
        what = f"{size['hours']:g} h (about {count} utterances)" if size["hours"] else f"{count} utterances"
        raise AsrflowError(
            f"text source {size['source']}: found {len(found)} usable sentences, {what} need {needed} "
            f"({needs['dev']} dev and {needs['test']} test sentences spoken once and never in train, "
            f"{needs['train']} train utterances at most {max_repeats} per sentence); "
            "lower --hours, raise --max-repeats or give a larger text source"
        )
    shuffled = list(found)
    random.Random(f"sentences-{seed}").shuffle(shuffled)
    test_end = needs["test"]
    dev_end = test_end + needs["dev"]
    return {"test": shuffled[:test_end], "dev": shuffled[test_end:dev_end], "train": shuffled[dev_end:]}


class _SentencePlanner:
    """Utterance ``index`` of a corpus of sentences: its voice as :func:`plan_utterance` draws it, its sentence
    the next of its split's pool (train's pool again from its start once spoken through, up to ``max_repeats``
    times). Utterances are planned in index order and kept, so that asking twice gives the same one."""

    def __init__(self, *, seed: int, voices: list[Voice], splits: dict[str, str], pools: dict, max_repeats: int):
        self.seed, self.voices, self.splits, self.pools, self.max_repeats = seed, voices, splits, pools, max_repeats
        self.spoken = dict.fromkeys(SPLITS, 0)
        self.planned: list[Utterance] = []

    def __call__(self, index: int) -> Utterance:
        while len(self.planned) <= index:
            self.planned.append(self._plan(len(self.planned)))
        return self.planned[index]

    def _plan(self, index: int) -> Utterance:
        voice = _voice_of(index, self.seed, self.voices)
        split = self.splits[voice.name]
        pool, spoken = self.pools[split], self.spoken[split]
        if spoken >= len(pool) * (self.max_repeats if split == "train" else 1):
            raise AsrflowError(
                f"utterance {index}: the {len(pool)} {split} sentences are all spoken (the audio is shorter than "
                "estimated); ask for fewer hours"
            )
        self.spoken[split] += 1
        return Utterance(index, voice, split, tuple(pool[spoken % len(pool)].split()))


def _planner(text: str | Path, *, seed: int, voices: list[Voice], splits: dict[str, str], options: dict):
    """The function from an utterance's index to the :class:`Utterance`, for ``text`` (see :data:`TEXTS`);
    ``options``: ``words``, ``word_range``, ``max_repeats``, ``hours``, ``utterances``; the count of
    sentences found is added to it."""
    if str(text) == "words":
        word_list = load_words(Path(options["words"]))
        word_range = options["word_range"]
        return functools.partial(
            plan_utterance, seed=seed, voices=voices, splits=splits, words=word_list, word_range=word_range
        )
    source = None if str(text) == "sentences" else Path(text)
    found = sentence_source.load_sentences(source, options["word_range"])
    options["sentences"] = len(found)
    size = {
        "hours": options["hours"],
        "utterances": options["utterances"],
        "source": source or sentence_source.FORTUNES_DIR,
    }
    pools = sentence_pools(
        found, seed=seed, voices=voices, splits=splits, size=size, max_repeats=options["max_repeats"]
    )
    return _SentencePlanner(seed=seed, voices=voices, splits=splits, pools=pools, max_repeats=options["max_repeats"])


def synthesize(utterance: Utterance, root: Path) -> int:
    """Speak ``utterance`` into ``root / utterance.path`` (16 kHz, 16-bit FLAC); its length in samples.

    Raises:
        AsrflowError: espeak-ng failed (its message is given).
    """
    import numpy as np
    import soundfile as sf

    resample_poly = require_extra("scipy.signal", "generate", "the spoken-corpus generator").resample_poly
    command = [ESPEAK, *utterance.voice.espeak_args(), "--stdout", utterance.text]
    done = subprocess.run(command, capture_output=True, check=False)
    if done.returncode != 0 or not done.stdout:
        message = done.stderr.decode(errors="replace").strip()
        raise AsrflowError(f"utterance {utterance.index}: {' '.join(command)} failed: {message or 'no audio'}")
    audio, rate = sf.read(io.BytesIO(done.stdout), dtype="float32")
    if rate != ESPEAK_RATE:
        raise AsrflowError(f"utterance {utterance.index}: {ESPEAK} spoke at {rate} Hz, expected {ESPEAK_RATE}")
    divisor = np.gcd(SAMPLING_RATE, ESPEAK_RATE)
    audio = resample_poly(audio, SAMPLING_RATE // divisor, ESPEAK_RATE // divisor)
    path = root / utterance.path
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, np.clip(audio, -1.0, 1.0), SAMPLING_RATE, format="FLAC", subtype="PCM_16")
    return len(audio)


@dataclass(kw_only=True)
class CorpusInfo:
    """What :func:`generate` wrote: sizes per split, the voices and their splits, and the options."""

    seed: int
    utterances: int
    audio_s: float
    sampling_rate: int
    splits: dict[str, dict[str, float]]
    voices: dict[str, str]
    options: dict


def _progress(total: float, unit: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, unit_scale=True, disable=not enabled, dynamic_ncols=True, desc="synthesizing")


def generate(
    out: Path,
    *,
    hours: float | None = None,
    utterances: int | None = None,
    seed: int = 0,
    voices: int = 100,
    text: str | Path = "words",
    words: Path | None = None,
    word_range: tuple[int, int] | None = None,
    max_repeats: int = MAX_REPEATS,
    jobs: int = 0,
    progress: bool = False,
) -> CorpusInfo:
    """Synthesize a corpus into ``out`` (format in the module docstring): ``utterances`` utterances, or as many
    as make ``hours`` hours of audio (utterances in index order until the total reaches it).

    Args:
        out: the corpus folder; must not exist yet (or be empty).
        hours / utterances: the size, exactly one of them.
        seed: everything (voices, splits, sentences) follows from it and the other options.
        voices: how many voices (at least 3).
        text: ``words`` (random words of ``words``), ``sentences`` (real sentences of Debian's fortunes, see
            :mod:`asrflow.generate.sentences`), or a text file or folder of fortune files to take sentences from.
        words: a word list (one word a line); default: :data:`WORDS`.
        word_range: fewest and most words a sentence; default 2-12 for words, 3-20 for sentences.
        max_repeats: most times a train sentence is spoken (sentences only; dev and test ones are spoken once).
        jobs: synthesis processes; 0 = one per usable core.
        progress: show a progress bar on stderr.
    Raises:
        AsrflowError: bad options, ``out`` not empty, espeak-ng missing or failing, too few sentences.
    """
    out = Path(out)
    if word_range is None:
        word_range = (2, 12) if str(text) == "words" else sentence_source.SENTENCE_WORDS
    _check_options(out, hours=hours, utterances=utterances, word_range=word_range, max_repeats=max_repeats)
    all_voices = make_voices(voices, seed)
    splits = split_of_voices(all_voices, seed)
    options = {"hours": hours, "utterances": utterances, "voices": voices, "text": str(text)}
    options |= {"words": str(words or WORDS), "word_range": list(word_range), "max_repeats": max_repeats}
    plan = _planner(text, seed=seed, voices=all_voices, splits=splits, options=options)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    jobs = jobs or len(os.sched_getaffinity(0))
    kept = _synthesize_until(partial, plan, hours=hours, utterances=utterances, jobs=jobs, progress=progress)
    info = _write_index(partial, kept, seed=seed, splits=splits, options=options)
    if out.exists():
        out.rmdir()
    partial.rename(out)
    return info


def _check_options(
    out: Path, *, hours: float | None, utterances: int | None, word_range: tuple[int, int], max_repeats: int
) -> None:
    """Refuse a size other than exactly one positive ``hours`` or ``utterances``, a bad ``word_range`` or
    ``max_repeats``, a non-empty ``out``, or a machine where espeak-ng does not run.

    Raises:
        AsrflowError: naming the option to fix.
    """
    if (hours is None) == (utterances is None):
        raise AsrflowError("give the corpus size as hours or as utterances, not both or neither")
    if (hours is not None and hours <= 0) or (utterances is not None and utterances < 1):
        raise AsrflowError(f"the corpus size must be positive (hours={hours}, utterances={utterances})")
    if not 1 <= word_range[0] <= word_range[1]:
        raise AsrflowError(f"word range {word_range}: give 1 <= fewest <= most")
    if max_repeats < 1:
        raise AsrflowError(f"max repeats {max_repeats}: give at least 1 (each train sentence spoken once)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise AsrflowError(f"{out} exists and is not empty; remove it or choose another --out")
    reason = espeak_missing()
    if reason:
        raise AsrflowError(reason)


def _synthesize_until(
    root: Path, plan, *, hours: float | None, utterances: int | None, jobs: int, progress: bool
) -> list[tuple[Utterance, int]]:
    """Synthesize utterances 0, 1, ... into ``root`` in ``jobs`` processes until there are ``utterances``
    of them, or until their audio reaches ``hours`` hours (the utterance that crosses it is kept).

    Utterances are planned by ``plan`` (index -> :class:`Utterance`, see :func:`_planner`) and spoken
    ``32 * jobs`` at a time; those of the last batch past the target are deleted.

    Returns:
        ``(utterance, length in samples at SAMPLING_RATE)`` of each kept utterance, in index order.
    """
    target_samples = round(hours * 3600 * SAMPLING_RATE) if hours is not None else None
    kept: list[tuple[Utterance, int]] = []
    total = 0
    batch = 32 * jobs
    bar = _progress(hours * 3600 if hours is not None else utterances, "audio s" if hours else "utt", progress)
    with bar, multiprocessing.get_context("spawn").Pool(jobs) as pool:
        for start in itertools.count(0, batch):
            stop = start + batch if utterances is None else min(start + batch, utterances)
            planned = [plan(i) for i in range(start, stop)]
            lengths = pool.map(_Synthesizer(root), planned, chunksize=4)
            finished = False
            for utterance, length in zip(planned, lengths, strict=True):
                if finished:
                    (root / utterance.path).unlink()
                    continue
                kept.append((utterance, length))
                total += length
                bar.update(length / SAMPLING_RATE if hours is not None else 1)
                finished = target_samples is not None and total >= target_samples
            if finished or (utterances is not None and stop >= utterances):
                break
        # the workers end on their own: the block's terminate() ends them with SIGTERM, which they ignore
        # when the process that started them does
        pool.close()
        pool.join()
    return kept


class _Synthesizer:
    """Picklable ``synthesize`` bound to the corpus folder, for the process pool."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __call__(self, utterance: Utterance) -> int:
        return synthesize(utterance, self.root)


def _write_index(
    root: Path, kept: list[tuple[Utterance, int]], *, seed: int, splits: dict[str, str], options: dict
) -> CorpusInfo:
    """The split TSVs and ``corpus.json`` of the utterances ``kept`` (with their lengths in samples)."""
    rows: dict[str, list[str]] = {split: [] for split in SPLITS}
    sizes = {split: {"utterances": 0, "audio_s": 0.0} for split in SPLITS}
    for utterance, length in kept:
        rows[utterance.split].append(f"{utterance.path}\t{utterance.text}\t{utterance.voice.name}\n")
        sizes[utterance.split]["utterances"] += 1
        sizes[utterance.split]["audio_s"] += length / SAMPLING_RATE
    for split, lines in rows.items():
        (root / f"{split}.tsv").write_text("".join(lines), encoding="utf-8")
    info = CorpusInfo(
        seed=seed,
        utterances=len(kept),
        audio_s=round(sum(length for _, length in kept) / SAMPLING_RATE, 3),
        sampling_rate=SAMPLING_RATE,
        splits={split: {**size, "audio_s": round(size["audio_s"], 3)} for split, size in sizes.items()},
        voices=dict(sorted(splits.items())),
        options=options,
    )
    (root / INFO_FILE).write_text(json.dumps(asdict(info), indent=1) + "\n", encoding="utf-8")
    return info


def read_info(corpus: Path) -> CorpusInfo:
    """The :class:`CorpusInfo` of a generated corpus (its ``corpus.json``)."""
    return CorpusInfo(**json.loads((Path(corpus) / INFO_FILE).read_text(encoding="utf-8")))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m asrflow.generate.spoken_corpus",
        description="Synthesize a spoken corpus with espeak-ng (corpus: folder layout, 16 kHz FLAC, split by voice). "
        "For scale and robustness figures only: synthetic speech says nothing about a real corpus.",
    )
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--hours", type=float, help="hours of audio to synthesize")
    size.add_argument("--utterances", type=int, help="number of utterances to synthesize")
    parser.add_argument("--out", type=Path, required=True, help="corpus folder to create (must not exist or be empty)")
    parser.add_argument("--seed", type=int, default=0, help="seed of voices, splits and sentences (default 0)")
    parser.add_argument("--voices", type=int, default=100, help="number of voices (default 100)")
    parser.add_argument(
        "--text",
        default="words",
        help="what is spoken: words (random words of --words, the default), sentences (real sentences of "
        "Debian's fortunes package), or a text file or folder of fortune files to take sentences from",
    )
    parser.add_argument("--words", type=Path, default=None, help=f"word list, one a line (default {WORDS.name})")
    parser.add_argument(
        "--min-words", type=int, default=None, help="fewest words a sentence (default 2; 3 for sentences)"
    )
    parser.add_argument(
        "--max-words", type=int, default=None, help="most words a sentence (default 12; 20 for sentences)"
    )
    parser.add_argument(
        "--max-repeats",
        type=int,
        default=MAX_REPEATS,
        help=f"most times a train sentence is spoken (default {MAX_REPEATS}; dev and test ones once, never in train)",
    )
    parser.add_argument("--jobs", type=int, default=0, help="synthesis processes (default 0: one per core)")
    return parser.parse_args(argv)


def _word_range(args: argparse.Namespace) -> tuple[int, int] | None:
    """``--min-words`` / ``--max-words``, the text's defaults where left out (``None`` when both are)."""
    if args.min_words is None and args.max_words is None:
        return None
    default = (2, 12) if args.text == "words" else sentence_source.SENTENCE_WORDS
    return (args.min_words or default[0], args.max_words or default[1])


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = generate(
        args.out,
        hours=args.hours,
        utterances=args.utterances,
        seed=args.seed,
        voices=args.voices,
        text=args.text,
        words=args.words,
        word_range=_word_range(args),
        max_repeats=args.max_repeats,
        jobs=args.jobs,
        progress=True,
    )
    sizes = ", ".join(f"{split} {size['utterances']}" for split, size in info.splits.items())
    print(f"{args.out}: {info.utterances} utterances ({sizes}), {info.audio_s / 3600:.2f} h", file=sys.stderr)


if __name__ == "__main__":
    main()
