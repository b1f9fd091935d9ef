"""Shared helpers of the benchmarks: JSON output, the machine, timing, and test data.

Every benchmark prints one JSON object per figure group on stdout (``emit``), with at
least ``benchmark`` and ``status`` (``ok``, or why it was not measured). Logs go to
stderr. Data that several benchmarks need (the prepared yesno corpus, a generated corpus)
is built once into a work folder (``--workdir``, shared by ``bench.run_all``) and reused.

The generated corpus is synthetic "speech": each word (``YES`` or ``NO``) is a harmonic
tone burst with its own pitch, separated by short pauses, plus background noise.
Utterance lengths are drawn uniformly from ``[min_s, max_s]`` seconds; the transcript
lists the words the audio holds. It is only meant for throughput and padding figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
YESNO_DIR = REPO / "data" / "corpora" / "yesno"
SAMPLING_RATE = 16000

os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- output
def emit(record: dict) -> dict:
    """Print ``record`` as one JSON line on stdout (``status`` defaults to ``ok``); returns it."""
    record = dict(record)
    record = {"benchmark": record.pop("benchmark"), "status": record.pop("status", "ok"), **record}
    print(json.dumps(record, default=_jsonable), flush=True)
    return record


def _jsonable(value):
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def ratio(value: float, baseline: float) -> float:
    """``value / baseline`` (NaN when the baseline is zero)."""
    return value / baseline if baseline else float("nan")


def rounded(value: float, digits: int = 4) -> float:
    """A float rounded to ``digits`` significant digits, for readable JSON."""
    if value == 0 or value != value or value in (float("inf"), float("-inf")):
        return value
    return float(f"{value:.{digits}g}")


# --------------------------------------------------------------------------- command line
def parse_args(
    description: str, argv: list[str] | None = None, configure: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    """``--quick`` (small sizes, for the smoke test) and ``--workdir`` (shared data cache).

    ``configure`` may add a benchmark's own options to the parser.
    """
    parser = argparse.ArgumentParser(description=description)
    if configure is not None:
        configure(parser)
    parser.add_argument("--quick", action="store_true", help="small sizes: checks that the benchmark runs")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="folder for generated data, reused across benchmarks (default: a temporary folder)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s [%(name)s] %(message)s", stream=sys.stderr, force=True
    )
    return args


@contextmanager
def workdir(path: Path | None):
    """``path`` (created), or a temporary folder removed at the end."""
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path.resolve()
        return
    tmp = Path(tempfile.mkdtemp(prefix="asrflow-bench-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- the machine
def load_average() -> list[float]:
    """1/5/15-minute load averages (other processes compete for the cores when high)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine() -> dict:
    """The machine the figures were measured on."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gib = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "usable_cores": usable,
        "memory_gib": memory_gib,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average": load_average(),
    }


# --------------------------------------------------------------------------- timing
def median_time(function: Callable[[], object], repeat: int) -> tuple[float, list[float]]:
    """Median wall seconds of ``repeat`` calls of ``function``, and every time measured."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def matmul_flops(size: int = 2048, repeat: int = 5, threads: int | None = None) -> float:
    """Measured fp32 FLOP/s of ``torch.mm`` on two ``size`` x ``size`` matrices (best of ``repeat``).

    The best, not the median, stands for the peak the machine can give; with ``threads``
    the torch thread count is set for the measurement and restored after it.
    """
    import torch

    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size)
        b = torch.randn(size, size)
        torch.mm(a, b)  # warm-up
        best = min(median_time(lambda: torch.mm(a, b), 1)[0] for _ in range(repeat))
    finally:
        torch.set_num_threads(previous)
    return 2 * size**3 / best


# --------------------------------------------------------------------------- data
@contextmanager
def one_thread_per_process():
    """Torch and OpenMP at one thread here and in processes spawned meanwhile, then restored.

    Used to build the benchmarks' data quickly: on 2 busy cores, several multi-threaded
    extraction processes oversubscribe the CPU (see ``bench.features_speed``).
    """
    import torch

    previous_threads = torch.get_num_threads()
    previous_env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous_threads)
        if previous_env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = previous_env


def repo_params() -> dict:
    """The repository's params.yaml."""
    from asrflow.params import load_params

    return load_params(REPO / "params.yaml")


def _data_sections(params: dict) -> dict:
    return {key: params.get(key) for key in ("seed", "prepare", "features", "tokenizer")}


def _done(folder: Path) -> bool:
    return (folder / ".done").is_file()


def _mark_done(folder: Path) -> None:
    (folder / ".done").write_text("")


def prepare_features_tokenizer(root: Path, prepare_config, num_jobs: int = 0, params: dict | None = None) -> Path:
    """prepare + features + tokenizer into ``root/{manifests,fbank,lang}``, as the stages do.

    Features and tokenizer use the sections of ``params`` (default: params.yaml), with
    ``num_jobs`` from here. The cuts point at features with absolute paths, so the folder
    works from any working directory.
    """
    from dataclasses import replace

    from asrflow.data.features import FeatureConfig, compute_features
    from asrflow.data.manifests import load_cuts
    from asrflow.data.prepare import prepare_corpus
    from asrflow.params import build_config
    from asrflow.tokenizer import TokenizerConfig, train_tokenizer

    params = params or repo_params()
    features = replace(build_config(FeatureConfig, params.get("features"), "features"), num_jobs=num_jobs)
    prepare_corpus(prepare_config, root / "manifests", seed=int(params.get("seed", 42)))
    compute_features(root / "manifests", root / "fbank", features)
    texts = [" ".join(s.text for s in cut.supervisions) for cut in load_cuts(root / "manifests", "train")]
    train_tokenizer(texts, root / "lang", build_config(TokenizerConfig, params.get("tokenizer"), "tokenizer"))
    return root


def yesno_data(work: Path, params: dict | None = None) -> Path:
    """The shipped yesno corpus prepared, with features and tokenizer (cached in ``work``).

    ``params`` (default: params.yaml) gives the seed and the prepare (its ``corpus_dir``
    aside), features and tokenizer sections; each set of their values is cached in a folder
    of its own (so a changed params.yaml never reuses stale data).
    """
    from asrflow.data.prepare import PrepareConfig

    params = params or repo_params()
    sections = _data_sections(params)
    root = work / f"yesno-{hashlib.sha256(json.dumps(sections, sort_keys=True).encode()).hexdigest()[:10]}"
    if _done(root):
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    with one_thread_per_process():
        section = {**params["prepare"], "corpus_dir": str(YESNO_DIR)}
        prepare_features_tokenizer(root, PrepareConfig.from_section(section), num_jobs=1, params=params)
    _mark_done(root)
    return root


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
    """One line of a features-stage train manifest (a Lhotse ``MonoCut`` with stored fbank) as a
    dict: the metadata of a cut whose audio and features need not exist, for scale tests."""
    supervision = {
        "id": cut_id,
        "recording_id": cut_id,
        "start": 0.0,
        "duration": duration,
        "channel": 0,
        "text": text,
    }
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
            "sampling_rate": 16000,
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
            "sampling_rate": 16000,
            "num_samples": int(duration * 16000),
            "duration": duration,
            "channel_ids": [0],
        },
        "type": "MonoCut",
    }


def synth_utterance(rng, duration_s: float) -> tuple[object, str]:
    """``duration_s`` seconds of tone-burst "words" in noise (float32 array), and its transcript."""
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

    Returns ``{"utterances": n, "audio_s": total seconds}``. Deterministic for ``seed``.
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
        duration = float(rng.uniform(min_s, max_s))
        audio, text = synth_utterance(rng, duration)
        name = f"wav/utt{index:05d}.wav"
        sf.write(folder / name, audio, SAMPLING_RATE, subtype="PCM_16")
        split = "dev" if index < n_dev else "test" if index < n_dev + n_test else "train"
        lines[split].append(f"{name}\t{text}")
        total_s += len(audio) / SAMPLING_RATE
    for split, rows in lines.items():
        (folder / f"{split}.tsv").write_text("\n".join(rows) + "\n")
    return {"utterances": num_utterances, "audio_s": total_s}


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


def data_features(data: Path):
    """The ``FeatureConfig`` that ``data/fbank`` was computed with (its ``config.json``): what a
    trainer on ``data`` must be given."""
    from asrflow.data.features import CONFIG_FILE, FeatureConfig

    return FeatureConfig(**json.loads((data / "fbank" / CONFIG_FILE).read_text()))


def params_for(data: Path, params: dict | None = None) -> dict:
    """``params`` (default: params.yaml) with the ``features`` section ``data`` was computed with."""
    from dataclasses import asdict

    params = dict(params or repo_params())
    params["features"] = {**params["features"], **asdict(data_features(data)), "num_jobs": 0}
    return params


def generated_features() -> dict:
    """The features section of a 16 kHz corpus (presets/real-corpus.yaml's), for generated corpora:
    params.yaml's are yesno's (8 kHz)."""
    from asrflow.params import load_params

    return load_params(REPO / "presets" / "real-corpus.yaml")["features"]


def generated_data(work: Path, num_utterances: int, seed: int = 0, dev_utterances: int = 2) -> Path:
    """A generated corpus of ``num_utterances`` (1-15 s, 16 kHz), prepared with features and tokenizer.

    ``dev_utterances`` of them go to dev, 2 to test. Cached in ``work/generated-<n>`` (with
    ``-dev<k>`` unless k is 2); features are a 16 kHz corpus's (:func:`generated_features`;
    train on them with :func:`data_features` / :func:`params_for`) and use all cores
    (``num_jobs: 0``) above 500 utterances, one thread per process.
    """
    from asrflow.data.prepare import PrepareConfig

    root = work / (f"generated-{num_utterances}" + ("" if dev_utterances == 2 else f"-dev{dev_utterances}"))
    if _done(root):
        return root
    shutil.rmtree(root, ignore_errors=True)
    start = time.perf_counter()
    # dev and test: 2 utterances each (they only have to exist for the stages)
    info = generate_corpus(
        root / "corpus", num_utterances, seed=seed, dev_fraction=dev_utterances / num_utterances, test_fraction=0.0
    )
    logger.info(
        "generated %d utterances (%.0f s of audio) in %.1f s",
        info["utterances"],
        info["audio_s"],
        time.perf_counter() - start,
    )
    config = PrepareConfig(
        corpus="folder",
        corpus_dir=str(root / "corpus"),
        splits={"train": "train", "dev": "dev", "test": "test"},
    )
    with one_thread_per_process():  # small corpora: one process (spawning workers costs more)
        params = {**repo_params(), "features": generated_features()}
        prepare_features_tokenizer(root, config, num_jobs=0 if num_utterances > 500 else 1, params=params)
    _mark_done(root)
    return root


# --------------------------------------------------------------------------- the repository
#: What :func:`copy_repo` (also the tests' copy) leaves out: environments, outputs, caches, tool
#: state, and ``bench/.peer`` (the peer toolkit's install), so a copy runs the pipeline from scratch.
COPY_IGNORE = (
    ".venv",
    ".git",
    "__pycache__",
    ".snakemake",
    "exp",
    "logs",
    "mlflow.db",
    "mlartifacts",
    "mlruns",
    "manifests",
    "fbank",
    "lang",
    ".pytest_cache",
    ".ruff_cache",
    "*.egg-info",
    ".dvc",
    ".peer",
)


def tool_env(copy: Path) -> dict[str, str]:
    """The environment for a tool run (Snakemake, DVC) in ``copy``, a copy of the repository: this
    interpreter's tools first on PATH, the copy's own MLflow store, no bytecode written into it."""
    env = os.environ.copy()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["GIT_PYTHON_REFRESH"] = "quiet"
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{copy}/mlflow.db"
    env["DVC_NO_ANALYTICS"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("VIRTUAL_ENV", None)
    return env


def copy_repo(destination: Path) -> Path:
    """A copy of the repository's own files (no venv, outputs or caches) for tool runs."""
    shutil.copytree(REPO, destination, ignore=shutil.ignore_patterns(*COPY_IGNORE))
    return destination
