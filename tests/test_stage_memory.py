"""Every stage's memory, read from outside as the machine sees it: the peak PSS of the stage's process tree
(the stage and its workers; :func:`tests.support.stage_memory.stage_peaks`), on a small input and on one
several times larger. A stage that held its split (cuts, features, results) would grow by far more than the
bound; what each may grow by, and why, is in each test. The bounds hold the tree's anonymous PSS, the memory it
made: the share of the libraries' file pages moves with whatever else on the machine maps them (the Slurm tests
beside these, in ``make test``), by more than a bound. Speed is not looked at here (bench/ is for that)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import yaml
from lhotse import CutSet
from lhotse.utils import fastcopy

from asrflow.data.manifests import cuts_path, load_cuts
from asrflow.data.prepare.config import PrepareConfig
from asrflow.data.prepare.corpus import prepare_corpus
from asrflow.evaluation.evaluate import SORT_WINDOW
from asrflow.generate.spoken_corpus import WORDS
from tests.support.corpora import copied_folder_corpus, feature_config, params_for, write_segment_manifests
from tests.support.processes import ChildProcess, tree_memory
from tests.support.repo import REPO, repo_params
from tests.support.stage_memory import stage_peaks

MB = 2**20
#: How often the tree's memory is read: fast enough for the peaks of stages that run for seconds.
POLL_S = 0.1


def peak_pss_mb(stage: str, argv: list[str], log: Path) -> float:
    """Peak tree PSS, its anonymous part (MB), of ``python -m stages.<stage> argv``; the whole PSS is printed."""
    found = stage_peaks(f"stages.{stage}", argv, log, poll_s=POLL_S)
    print(stage, {key: found[key] for key in ("peak_tree_pss_mb", "peak_tree_anon_pss_mb")})
    return found["peak_tree_anon_pss_mb"]


def test_the_anonymous_pss_is_what_the_tree_made_whatever_else_maps_its_libraries():
    """A process holding 64 MB: its tree's anonymous PSS holds them, and stays put when three more processes map
    the same interpreter and libraries, while the whole PSS (their file pages' share) falls."""
    hold = "import sys, time; kept = bytearray(64 << 20); kept[::4096] = b'x' * len(kept[::4096]); "
    command = [sys.executable, "-c", hold + "print(flush=True); time.sleep(60)"]
    started = []
    try:
        started.append(subprocess.Popen(command, stdout=subprocess.PIPE))
        started[0].stdout.readline()
        alone = tree_memory(started[0].pid)
        started += [subprocess.Popen(command, stdout=subprocess.PIPE) for _ in range(3)]
        for other in started[1:]:
            other.stdout.readline()
        time.sleep(0.2)
        shared = tree_memory(started[0].pid)
    finally:
        for process in started:
            process.kill()
            process.wait()
    assert alone.anon_pss > 64 * MB, alone
    assert abs(shared.anon_pss - alone.anon_pss) < MB, (alone, shared)
    assert shared.pss - shared.anon_pss < alone.pss - alone.anon_pss, (alone, shared)


def write_params(path: Path, params: dict) -> str:
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return str(path)


def repeated_split(fbank: Path, out: Path, split: str, times: int, *, duration_s: float | None = None) -> Path:
    """A copy of the features folder ``fbank`` whose ``split`` lists its cuts ``times`` over, each under a new
    id, cut to its first ``duration_s`` seconds when given, and pointing at the same stored features."""
    out.mkdir(parents=True)
    for name in ("cmvn.json", "config.json"):
        shutil.copyfile(fbank / name, out / name)
    for other in ("train", "dev", "test"):
        cuts = CutSet.from_file(cuts_path(fbank, other))
        if other == split:
            if duration_s is not None:
                cuts = cuts.truncate(max_duration=duration_s, offset_type="start")
            cuts = CutSet.from_cuts(cut.with_id(f"{cut.id}-{k}") for k in range(times) for cut in cuts)
        cuts.to_file(cuts_path(out, other))
    return out


@pytest.mark.slow
def test_prepare(tmp_path):
    """8x the utterances (500 → 4,000 audio files). Prepare streams items through sorts on disk that hold
    :data:`~asrflow.data.prepare.spool.DEFAULT_CHUNK_LINES` manifest lines (about 1.3 kB each) in memory at a
    time, and keeps each id (duplicates) and each recording's count (carving): below a chunk the peak grows
    by at most 3 kB per added utterance, where held Lhotse cuts would take about 7."""
    params = repo_params()
    peaks = {}
    for count in (500, 4000):
        splits = {"train": "train", "dev": "dev", "test": "test"}
        params["prepare"] |= {"corpus": "folder", "corpus_dir": str(copied_folder_corpus(tmp_path, count))}
        params["prepare"]["splits"] = splits
        argv = ["--params", write_params(tmp_path / f"params-{count}.yaml", params)]
        peaks[count] = peak_pss_mb("prepare", [*argv, "--out", str(tmp_path / f"m-{count}")], tmp_path / f"{count}.log")
    assert sum(1 for _ in load_cuts(tmp_path / "m-4000", "train")) == 4000 * 48 // 50
    print(json.dumps(peaks))
    assert peaks[4000] - peaks[500] < 3500 * 3000 / MB, peaks


def resampled_corpus(root: Path, count: int) -> Path:
    """Manifests of ``count`` 22,050 Hz WAV files of 1-3 s, one per utterance and each of its own length (as
    espeak-ng and many real corpora write them), prepared as the prepare stage does."""
    rate, rng = 22_050, np.random.default_rng(count)
    corpus = root / f"corpus-{count}"
    corpus.mkdir()
    rows: dict[str, list[str]] = {"train": [], "dev": [], "test": []}
    for index in range(count):
        samples = int(rate * (1.0 + 2.0 * index / count))
        name = f"u{index:05d}.wav"
        sf.write(corpus / name, 0.1 * rng.standard_normal(samples), rate)
        rows["dev" if index < 2 else "test" if index < 4 else "train"].append(f"{name}\tHELLO")
    for split, lines in rows.items():
        (corpus / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    splits = {"train": "train", "dev": "dev", "test": "test"}
    config = PrepareConfig.from_section({"corpus": "folder", "corpus_dir": str(corpus), "splits": splits})
    prepare_corpus(config, root / f"m-{count}", seed=0)
    return root / f"m-{count}"


@pytest.mark.slow
def test_features_resampled(tmp_path):
    """4x the files (300 → 1,200 WAV files at 22,050 Hz, each of its own length, resampled to 16 kHz, one job):
    extraction streams cut by cut into the storage and resamples without oneDNN, which kept a primitive per
    input length (about 200 kB a file). The peak may not grow by 10 kB per added file: a cut's features held
    would take about 60 kB."""
    peaks = {}
    argv = ["--params", write_params(tmp_path / "params.yaml", {"features": asdict(feature_config(num_jobs=1))})]
    for count in (300, 1200):
        out = ["--manifests", str(resampled_corpus(tmp_path, count)), "--out", str(tmp_path / f"fbank-{count}")]
        peaks[count] = peak_pss_mb("features", [*argv, *out], tmp_path / f"{count}.log")
    assert sum(1 for _ in load_cuts(tmp_path / "fbank-1200", "train")) == 1196
    print(json.dumps(peaks))
    assert peaks[1200] - peaks[300] < 900 * 10_000 / MB, peaks


def with_sentences(folder: Path, split: str, seed: int) -> None:
    """Give every cut of ``split`` in ``folder`` a transcript of 8 random words (about 60 characters)."""
    words = WORDS.read_text().upper().split()
    rng = random.Random(seed)
    cuts = CutSet.from_file(cuts_path(folder, split)).to_eager()
    sentences = [" ".join(rng.choices(words, k=8)) for _ in cuts]
    relabelled = (
        cut.map_supervisions(lambda supervision, text=text: fastcopy(supervision, text=text))
        for cut, text in zip(cuts, sentences, strict=True)
    )
    CutSet.from_cuts(relabelled).to_file(cuts_path(folder, split))


@pytest.mark.slow
def test_tokenizer(tmp_path):
    """40x the transcripts (500 → 20,000 of about 60 characters): SentencePiece trains on every sentence in
    memory (their counts are its statistics), so the peak grows with the text, but by its size, not by cuts:
    at most 2 kB per added transcript (the stage's peak also varies from run to run: bench/RESULTS.md#stage-memory)."""
    params, peaks = repo_params(), {}
    params["tokenizer"] |= {"model_type": "bpe", "vocab_size": 100}
    argv = ["--params", write_params(tmp_path / "params.yaml", params)]
    for count in (500, 20_000):
        folder = tmp_path / f"m-{count}"
        write_segment_manifests(folder, tmp_path / "audio", {"train": count, "dev": 2, "test": 2}, recording_s=12.0)
        with_sentences(folder, "train", seed=count)
        out = ["--manifests", str(folder), "--out", str(tmp_path / f"lang-{count}")]
        peaks[count] = peak_pss_mb("tokenizer", [*argv, *out], tmp_path / f"{count}.log")
    print(json.dumps(peaks))
    assert peaks[20_000] - peaks[500] < 19_500 * 2000 / MB, peaks


@pytest.mark.slow
def test_evaluate(tmp_path, yesno_data, yesno_model):
    """8x the test set (2,000 → 16,000 cuts of 0.3 s; one window of
    :data:`~asrflow.evaluation.evaluate.SORT_WINDOW` cuts, then eight): evaluate holds one window of cut
    manifests and writes each result as it comes, so the peak may not grow by 1 kB per added cut (a window's
    cuts take about 8 kB each). Decoded in batches of 20 s: a batch's activations come and go faster than the
    tree is read, so at the default 200 s their top, caught in one run and missed in the other, would move the
    peak by more than the bound; at 20 s it stays below what the stage keeps."""
    assert SORT_WINDOW == 2000
    params = params_for(yesno_data)
    params["evaluate"] |= {"max_batch_duration_s": 20.0}
    argv = ["--params", write_params(tmp_path / "params.yaml", params), "--model", str(yesno_model)]
    peaks = {}
    for times in (67, 536):  # yesno's 30 test cuts: 2,010 and 16,080
        fbank = repeated_split(yesno_data / "fbank", tmp_path / f"fbank-{times}", "test", times, duration_s=0.3)
        out = ["--fbank", str(fbank), "--out", str(tmp_path / f"eval-{times}")]
        peaks[times] = peak_pss_mb("evaluate", [*argv, *out], tmp_path / f"{times}.log")
    scored = json.loads((tmp_path / "eval-536" / "metrics.json").read_text())
    assert scored["num_utterances"] == 16_080, scored
    print(json.dumps(peaks))
    assert peaks[536] - peaks[67] < 14_070 * 1000 / MB, peaks


def train_peak_pss_mb(run_dir: Path, fbank: Path, lang: Path, steps: int) -> float:
    """Peak tree PSS, its anonymous part (MB), of the train stage on ``fbank`` from its start to optimizer step
    ``steps`` (then it is stopped by SIGTERM; what it does to stop is not counted)."""
    command = [sys.executable, "-m", "stages.train", "--params", "params.yaml", "--exp", "exp"]
    command += ["--fbank", str(fbank), "--lang", str(lang)]
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MLFLOW_", "ASRFLOW_"))}
    env |= {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    process = ChildProcess(command, log_path=run_dir / "train.log", env=env, cwd=run_dir, memory_poll_s=POLL_S)
    process.wait_for(f"[asrflow.training.monitoring] step {steps} epoch", 300)
    peak = process.peak_anon_pss  # read now: the poller goes on while the stage stops
    process.process.send_signal(signal.SIGTERM)
    assert process.wait(120) == 75, process.tail()
    return peak / MB


@pytest.mark.slow
def test_train(tmp_path, yesno_data):
    """The train split 1,000x larger (27 → 27,000 cuts), the same 20 steps. The stage builds the split's cut
    index in its process (the lines stay on disk) and an epoch's plan of indices (what it measured:
    bench/RESULTS.md#stage-memory). It may not grow by 4 kB per added cut, where held Lhotse cuts would take
    several times that."""
    params = params_for(yesno_data)
    params["train"]["optim"] |= {"epochs": 1000}
    params["train"]["checkpoint"] |= {"checkpoint_every_steps": 10, "validate_every_steps": 10}
    peaks = {}
    for times in (1, 1000):
        run_dir = tmp_path / f"run-{times}"
        fbank = repeated_split(yesno_data / "fbank", tmp_path / f"fbank-{times}", "train", times)
        run_dir.mkdir()
        write_params(run_dir / "params.yaml", params)
        peaks[times] = train_peak_pss_mb(run_dir, fbank, yesno_data / "lang", steps=20)
    print(json.dumps(peaks))
    assert peaks[1000] - peaks[1] < 26_973 * 4000 / MB, peaks
