"""Corpora for tests and benchmarks: tone-burst utterances, generated folder corpora, prepared yesno.

The generated corpus is synthetic "speech": each word (``YES`` or ``NO``) is a harmonic tone
burst with its own pitch, separated by short pauses, in background noise. It is meant for
throughput, padding and memory figures, not for accuracy. A prepared corpus is a folder with
``manifests/``, ``fbank/`` and ``lang/`` whose cuts point at their features by absolute path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from tests.support.repo import REPO, YESNO_DIR, repo_params

if TYPE_CHECKING:
    from asrflow.data.features.config import FeatureConfig
    from asrflow.tokenizer import TokenizerConfig

SAMPLING_RATE = 16000

logger = logging.getLogger(__name__)


def synth_utterance(rng, duration_s: float) -> tuple[object, str]:
    """``duration_s`` seconds of tone-burst "words" in noise (float32 array at 16 kHz), and its transcript."""
    import numpy as np

    total = round(duration_s * SAMPLING_RATE)
    audio = np.zeros(total, dtype=np.float32)
    words = []
    pos = int(rng.uniform(0.05, 0.2) * SAMPLING_RATE)
    pitches = {"YES": 310.0, "NO": 190.0}
    while True:
        word = "YES" if rng.random() < 0.5 else "NO"
        length = int(rng.uniform(0.3, 0.5) * SAMPLING_RATE)
        if pos + length > total - int(0.05 * SAMPLING_RATE):
            break
        t = np.arange(length, dtype=np.float32) / SAMPLING_RATE
        f0 = pitches[word] * rng.uniform(0.9, 1.1)
        tone = sum(np.sin(2 * np.pi * k * f0 * t) / k for k in (1, 2, 3))
        envelope = np.sin(np.pi * np.arange(length) / length).astype(np.float32)
        audio[pos : pos + length] += 0.3 * tone * envelope
        words.append(word)
        pos += length + int(rng.uniform(0.1, 0.3) * SAMPLING_RATE)
    if not words:  # very short: one short word filling most of it
        length = int(0.8 * total)
        t = np.arange(length, dtype=np.float32) / SAMPLING_RATE
        audio[:length] += 0.3 * np.sin(2 * np.pi * pitches["NO"] * t)
        words.append("NO")
    audio += rng.normal(0.0, 0.01, total).astype(np.float32)
    return audio, " ".join(words)


def generate_corpus(
    folder: Path,
    num_utterances: int,
    *,
    seed: int = 0,
    min_s: float = 1.0,
    max_s: float = 15.0,
    dev_fraction: float = 0.02,
    test_fraction: float = 0.02,
) -> dict:
    """Write a ``corpus: folder`` corpus (16 kHz WAVs + train/dev/test TSVs) into ``folder``.

    Utterance lengths are uniform in ``[min_s, max_s]`` seconds. Returns ``{"utterances": n,
    "audio_s": total seconds}``. Deterministic for ``seed``.
    """
    import numpy as np
    import soundfile as sf

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "wav").mkdir(exist_ok=True)
    rng = np.random.default_rng(seed)
    lines: dict[str, list[str]] = {"train": [], "dev": [], "test": []}
    n_dev = max(2, round(dev_fraction * num_utterances))
    n_test = max(2, round(test_fraction * num_utterances))
    total_s = 0.0
    for index in range(num_utterances):
        audio, text = synth_utterance(rng, float(rng.uniform(min_s, max_s)))
        name = f"wav/utt{index:05d}.wav"
        sf.write(folder / name, audio, SAMPLING_RATE, subtype="PCM_16")
        split = "dev" if index < n_dev else "test" if index < n_dev + n_test else "train"
        lines[split].append(f"{name}\t{text}")
        total_s += len(audio) / SAMPLING_RATE
    for split, rows in lines.items():
        (folder / f"{split}.tsv").write_text("\n".join(rows) + "\n")
    return {"utterances": num_utterances, "audio_s": total_s}


def cut_entry(
    cut_id: str,
    duration: float,
    *,
    text: str,
    storage_path: str,
    storage_key: str,
    source: str,
    speaker: str | None = None,
) -> dict:
    """One line of a features-stage manifest (a Lhotse ``MonoCut`` with stored fbank) as a dict: the
    metadata of a cut whose audio and features need not exist, for manifests of millions of cuts."""
    supervision = {"id": cut_id, "recording_id": cut_id, "start": 0.0, "duration": duration, "channel": 0}
    supervision["text"] = text
    if speaker is not None:
        supervision["speaker"] = speaker
    return {
        "id": cut_id,
        "start": 0.0,
        "duration": duration,
        "channel": 0,
        "supervisions": [supervision],
        "features": {
            "type": "kaldi-fbank",
            "num_frames": int(round(duration * 100)),
            "num_features": 80,
            "frame_shift": 0.01,
            "sampling_rate": SAMPLING_RATE,
            "start": 0.0,
            "duration": duration,
            "storage_type": "lilcom_chunky",
            "storage_path": storage_path,
            "storage_key": storage_key,
            "channels": 0,
        },
        "recording": {
            "id": cut_id,
            "sources": [{"type": "file", "channels": [0], "source": source}],
            "sampling_rate": SAMPLING_RATE,
            "num_samples": int(duration * SAMPLING_RATE),
            "duration": duration,
            "channel_ids": [0],
        },
        "type": "MonoCut",
    }


@contextmanager
def torch_threads(count: int | None = 1):
    """``count`` torch threads here and OpenMP threads in processes spawned meanwhile (None: unchanged),
    then restored: several multi-threaded extraction processes would oversubscribe a small machine."""
    import torch

    previous, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    if count:
        torch.set_num_threads(count)
        os.environ["OMP_NUM_THREADS"] = str(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env


def folder_corpus(corpus_dir: Path):
    """The ``PrepareConfig`` of a ``corpus: folder`` corpus with train, dev and test TSVs (:func:`generate_corpus`)."""
    from asrflow.data.prepare.config import PrepareConfig

    splits = {"train": "train", "dev": "dev", "test": "test"}
    return PrepareConfig(corpus="folder", corpus_dir=str(corpus_dir), splits=splits)


def write_folder_corpus(corpus_dir: Path, splits: dict[str, list[tuple[Path, str]]]) -> Path:
    """A ``corpus: folder`` corpus made of existing audio: ``<split>.tsv`` per split, each file copied in.

    Args:
        corpus_dir: the folder to write (created).
        splits: the corpus' split name -> ``(audio file, transcript)`` of its utterances; a
            file keeps its name, so names must differ across splits.

    Returns:
        ``corpus_dir``.
    """
    corpus_dir.mkdir(parents=True, exist_ok=True)
    for split, files in splits.items():
        rows = []
        for audio, text in files:
            shutil.copyfile(audio, corpus_dir / Path(audio).name)
            rows.append(f"{Path(audio).name}\t{text}")
        (corpus_dir / f"{split}.tsv").write_text("\n".join(rows) + "\n")
    return corpus_dir


def prepare_features_tokenizer(root: Path, prepare, features, tokenizer, *, seed: int = 42) -> Path:
    """prepare + features + tokenizer into ``root/{manifests,fbank,lang}``, as the stages run them,
    from a ``PrepareConfig``, a ``FeatureConfig`` and a ``TokenizerConfig``."""
    from asrflow.data.features.extract import compute_features
    from asrflow.data.manifests import load_cuts
    from asrflow.data.prepare.corpus import prepare_corpus
    from asrflow.tokenizer import train_tokenizer

    prepare_corpus(prepare, root / "manifests", seed=seed)
    compute_features(root / "manifests", root / "fbank", features)
    texts = [" ".join(s.text for s in cut.supervisions) for cut in load_cuts(root / "manifests", "train")]
    train_tokenizer(texts, root / "lang", tokenizer)
    return root


def prepare_from_params(root: Path, prepare, params: dict, num_jobs: int) -> Path:
    """:func:`prepare_features_tokenizer` with the features and tokenizer sections of ``params``."""
    from dataclasses import replace

    from asrflow.data.features.config import FeatureConfig
    from asrflow.params import build_config
    from asrflow.tokenizer import TokenizerConfig

    features = replace(build_config(FeatureConfig, params.get("features"), "features"), num_jobs=num_jobs)
    tokenizer = build_config(TokenizerConfig, params.get("tokenizer"), "tokenizer")
    return prepare_features_tokenizer(root, prepare, features, tokenizer, seed=int(params.get("seed", 42)))


def prepare_yesno(root: Path) -> Path:
    """The shipped yesno corpus prepared into ``root`` with params.yaml's prepare section,
    :func:`feature_config` (16 kHz / 80 bins, one extraction job) and :func:`tokenizer_config` (char, 32)."""
    from asrflow.data.prepare.config import PrepareConfig

    prepare = PrepareConfig(corpus_dir=str(YESNO_DIR))
    return prepare_features_tokenizer(root, prepare, feature_config(num_jobs=1), tokenizer_config())


def _cached(root: Path, build) -> Path:
    """``root`` built once by ``build(root)``; a ``.done`` marker tells a finished build from a cut one."""
    if (root / ".done").is_file():
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    build(root)
    (root / ".done").write_text("")
    return root


def yesno_data(work: Path, params: dict | None = None) -> Path:
    """The shipped yesno corpus prepared with the prepare, features and tokenizer sections of ``params``
    (default: params.yaml), cached in ``work`` per set of their values."""
    from asrflow.data.prepare.config import PrepareConfig

    params = params or repo_params()
    sections = {key: params.get(key) for key in ("seed", "prepare", "features", "tokenizer")}
    digest = hashlib.sha256(json.dumps(sections, sort_keys=True).encode()).hexdigest()[:10]

    def build(root: Path) -> None:
        with torch_threads(1):
            prepare = PrepareConfig.from_section({**params["prepare"], "corpus_dir": str(YESNO_DIR)})
            prepare_from_params(root, prepare, params, num_jobs=1)

    return _cached(work / f"yesno-{digest}", build)


def real_corpus_params() -> dict:
    """params.yaml with presets/real-corpus.yaml applied (nothing written)."""
    from asrflow.presets import preset_params

    return preset_params(repo_params(), REPO / "presets" / "real-corpus.yaml")


def generated_features() -> dict:
    """The features section of a 16 kHz corpus (the real-corpus preset's); params.yaml's are yesno's."""
    return real_corpus_params()["features"]


def feature_config(**changes) -> FeatureConfig:
    """The ``FeatureConfig`` the tests extract with: :func:`generated_features` (params.yaml's section at
    16000 Hz / 80 bins, the rate of the generated corpora and of a real corpus; params.yaml's own 8000 / 40 suit
    only yesno), with ``changes``. The yesno fixtures use it too: 16 kHz is the rate the tests were written at."""
    from asrflow.data.features.config import FeatureConfig
    from asrflow.params import build_config

    return build_config(FeatureConfig, {**generated_features(), **changes}, "features")


def tokenizer_config(**changes) -> TokenizerConfig:
    """The ``TokenizerConfig`` the tests train: params.yaml's section as a char model of at most 32 pieces, with
    ``changes``. A char model's size is only an upper bound, so it trains on any of the tests' small texts
    (params.yaml's 13-piece BPE is sized for yesno's two words), and 32 holds every character they use."""
    from asrflow.tokenizer import TokenizerConfig
    from tests.support.repo import repo_config

    return repo_config(TokenizerConfig, "tokenizer", **{"model_type": "char", "vocab_size": 32, **changes})


def generated_data(work: Path, num_utterances: int, seed: int = 0, dev_utterances: int = 2) -> Path:
    """A generated corpus of ``num_utterances`` (1-15 s, 16 kHz; ``dev_utterances`` in dev, 2 in test),
    prepared with :func:`generated_features`, cached in ``work``; train on it with :func:`params_for`."""

    def build(root: Path) -> None:
        start = time.perf_counter()
        dev_fraction = dev_utterances / num_utterances
        info = generate_corpus(root / "corpus", num_utterances, seed=seed, dev_fraction=dev_fraction, test_fraction=0)
        took = time.perf_counter() - start
        logger.info("generated %d utterances (%.0f s of audio) in %.1f s", num_utterances, info["audio_s"], took)
        prepare = folder_corpus(root / "corpus")
        with torch_threads(1):  # small corpora: one process (spawning workers costs more)
            params = {**repo_params(), "features": generated_features()}
            prepare_from_params(root, prepare, params, num_jobs=0 if num_utterances > 500 else 1)

    suffix = "" if dev_utterances == 2 else f"-dev{dev_utterances}"
    return _cached(work / f"generated-{num_utterances}{suffix}", build)


def data_features(data: Path):
    """The ``FeatureConfig`` that ``data/fbank`` was computed with: what a trainer on ``data`` must be given."""
    from asrflow.data.features.config import CONFIG_FILE, FeatureConfig

    return FeatureConfig(**json.loads((data / "fbank" / CONFIG_FILE).read_text()))


def params_for(data: Path, params: dict | None = None) -> dict:
    """``params`` (default: params.yaml) with the ``features`` section ``data`` was computed with."""
    from dataclasses import asdict

    params = dict(params or repo_params())
    params["features"] = {**params["features"], **asdict(data_features(data)), "num_jobs": 0}
    return params


def write_segment_manifests(
    folder: Path,
    audio_dir: Path,
    cuts_per_split: dict[str, int],
    *,
    seed: int = 0,
    min_s: float = 0.5,
    max_s: float = 1.5,
    recordings: int = 8,
    recording_s: float = 60.0,
) -> float:
    """Cut manifests as the prepare stage writes them (sorted by id), of any size, at little cost.

    ``recordings`` generated recordings of ``recording_s`` seconds (16 kHz FLAC, in ``audio_dir``)
    are cut into ``cuts_per_split[split]`` segments of ``min_s``-``max_s`` seconds at random
    offsets: every cut has its own length, and the audio on disk stays the same whatever the
    count. Deterministic for ``seed``. Returns the seconds of audio listed.
    """
    import numpy as np
    import soundfile as sf
    from lhotse import CutSet, MonoCut, Recording, SupervisionSegment

    from asrflow.data.manifests import cuts_path

    rng = np.random.default_rng(seed)
    audio_dir.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    pool = []
    for index in range(recordings):
        path = audio_dir / f"long{index:03d}.flac"
        if not path.is_file():
            audio, _text = synth_utterance(rng, recording_s)
            sf.write(path, audio, SAMPLING_RATE, format="FLAC", subtype="PCM_16")
        pool.append(Recording.from_file(path, recording_id=f"long{index:03d}"))
    total = 0.0
    for split, count in cuts_per_split.items():
        with CutSet.open_writer(cuts_path(folder, split)) as writer:
            for index in range(count):
                recording = pool[index % len(pool)]
                duration = round(float(rng.uniform(min_s, max_s)), 3)
                start = round(float(rng.uniform(0.0, recording.duration - duration)), 3)
                cut_id = f"{split}-{index:08d}"
                supervision = SupervisionSegment(cut_id, recording.id, 0.0, duration, channel=0, text="YES NO")
                writer.write(
                    MonoCut(cut_id, start, duration, channel=0, recording=recording, supervisions=[supervision])
                )
                total += duration
    return total


def copied_folder_corpus(root: Path, count: int) -> Path:
    """A ``corpus: folder`` corpus of ``count`` FLAC files, each a copy of one of 8 synthesized utterances
    of 0.8-2 s, 105 speakers in the TSVs' third column, 2 % dev and 2 % test (cached under ``root``)."""
    import numpy as np
    import soundfile as sf

    def build(folder: Path) -> None:
        rng, templates = np.random.default_rng(0), []
        for index in range(8):
            audio, text = synth_utterance(rng, 0.8 + 1.2 * index / 7)
            sf.write(folder / f"template-{index}.flac", audio, SAMPLING_RATE)
            templates.append((folder / f"template-{index}.flac", text))
        lines: dict[str, list[str]] = {"train": [], "dev": [], "test": []}
        for index in range(count):
            template, text = templates[index % 8]
            name = f"audio/{index // 1000:04d}/utt{index:07d}.flac"
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(template, folder / name)
            split = "dev" if index % 50 == 0 else "test" if index % 50 == 1 else "train"
            lines[split].append(f"{name}\t{text}\tspk{index % 105:03d}")
        for split, rows in lines.items():
            (folder / f"{split}.tsv").write_text("\n".join(rows) + "\n")

    return _cached(root / f"folder-{count}", build)


def kaldi_corpus(root: Path, count: int, *, recordings: int = 10, recording_s: float = 300.0) -> Path:
    """A Kaldi data folder ``train/`` of ``count`` segments of 0.5-2 s at random times (they may overlap) over
    ``recordings`` FLAC tones of ``recording_s``, 200 speakers in ``utt2spk`` (cached under ``root``)."""
    import numpy as np
    import soundfile as sf

    def build(folder: Path) -> None:
        data = folder / "train"
        data.mkdir()
        rng = np.random.default_rng(0)
        t = np.arange(int(recording_s * SAMPLING_RATE), dtype=np.float32) / SAMPLING_RATE
        with open(data / "wav.scp", "w") as scp:
            for rec in range(recordings):
                sf.write(folder / f"rec{rec:02d}.flac", 0.1 * np.sin(2 * np.pi * (200 + 20 * rec) * t), SAMPLING_RATE)
                scp.write(f"rec{rec:02d} rec{rec:02d}.flac\n")
        words = ["YES", "NO", "MAYBE", "HELLO", "WORLD", "AGAIN"]
        starts, lengths = rng.uniform(0, recording_s - 2.5, count), rng.uniform(0.5, 2.0, count)
        with open(data / "segments", "w") as seg, open(data / "text", "w") as txt, open(data / "utt2spk", "w") as spk:
            for i in range(count):
                speaker = f"spk{i % 200:03d}"
                utt = f"{speaker}-{i:08d}"
                seg.write(f"{utt} rec{i % recordings:02d} {starts[i]:.2f} {starts[i] + lengths[i]:.2f}\n")
                txt.write(f"{utt} {words[i % 6]} {words[(i // 6) % 6]}\n")
                spk.write(f"{utt} {speaker}\n")

    return _cached(root / f"kaldi-{count}", build)
