"""Measure the machine this runs on and write what is fastest here as a preset of overrides.

The defaults in params.yaml were chosen on some machines; the best precision, thread count and number of
data workers differ by CPU model (a CPU's bf16 kernels may be faster or slower than its fp32 ones for this
model's shapes) and by GPU. In a minute or two this command trains a few real optimizer steps of
params.yaml's model on synthetic batches of many shapes (as length-bucketed training meets them: a CPU's bf16
kernels are set up anew for each), in each candidate setting, and writes the winners::

    python -m asrflow.training.tune [--params params.yaml] [--out presets/machine-<cpu>.yaml] [--seconds 60]
    python -m asrflow.presets presets/machine-<cpu>.yaml      # apply it; commit both to keep the choice

Measured: the step's audio seconds per second in each precision (fp32 and bf16 on the CPU; fp32, bf16 and
fp16 on a GPU) and at each torch thread count (CPU); the fbank rate of one data worker (with
``features.on_the_fly``), giving the workers that keep up with the step; and the memory a batch takes per
second of audio, giving the largest batch that fits (RAM on the CPU, the GPU's memory on a GPU).
``train.data.max_duration_s`` is a training hyper-parameter, so it is only lowered, when params.yaml's batch
would not fit. The preset holds only the keys whose best value differs from params.yaml's, and names the
machine (CPU model and flags, GPU) and every figure it measured.
"""

from __future__ import annotations

import argparse
import logging
import math
import multiprocessing
import os
import platform
import random
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import torch

from asrflow.allocator import environment_with_jemalloc, jemalloc_to_preload, loaded_allocator
from asrflow.cores import available_cores
from asrflow.data.loading.planner import BatchItem, padded_frames
from asrflow.errors import exit_on_user_error
from asrflow.logs import setup_logging
from asrflow.model.conformer_ctc import subsampled_lengths
from asrflow.params import load_params
from asrflow.training.assemble import configure_process, process_report
from asrflow.training.parts import RunPlace, build_run_model, build_step_context
from asrflow.training.precision import precision_for
from asrflow.training.run_state import seed_everything
from asrflow.training.settings import TrainingSettings
from asrflow.training.step import train_step

logger = logging.getLogger(__name__)

#: Seconds of audio per synthetic utterance: a typical sentence.
UTTERANCE_S = 8.0
#: Batch shapes a speed measurement steps through in turn. Length-bucketed training rarely repeats a shape, and
#: a CPU's bf16 kernels (oneDNN's, on AMX too) are set up for each new one: one repeated shape would time bf16
#: without that cost.
SHAPES = 48
#: Largest batch (seconds of audio) a speed measurement uses: ratios between settings hold at any batch,
#: and a preset's 600 s batch would take minutes a step on a CPU.
SPEED_BATCH_S = 32.0
#: Share of the free memory a batch may take (the rest: the data, the allocator's slack, other processes).
MEMORY_SHARE = 0.7
#: A setting must be this much faster than params.yaml's to replace it (timing noise is a few per cent).
MIN_GAIN = 1.1
#: CPU flags that decide which kernels oneDNN runs (recorded with every figure): native bf16 (AVX-512 BF16,
#: AMX), AVX-512 and its int8 dot products, AVX2 and FMA.
RELEVANT_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "amx_int8", "avx512f", "avx512_vnni", "avx2", "fma")


@dataclass(frozen=True, kw_only=True)
class Machine:
    """What the figures were measured on."""

    cpu: str
    flags: tuple[str, ...]
    usable_cores: int
    memory_gib: float
    gpu: str | None

    @classmethod
    def here(cls, cpuinfo: Path = Path("/proc/cpuinfo")) -> Machine:
        """This machine (``cpuinfo``: where Linux lists the CPU; elsewhere the model name is the platform's)."""
        info = cpuinfo.read_text() if cpuinfo.is_file() else ""
        names = re.findall(r"^model name\s*:\s*(.+)$", info, re.MULTILINE)
        flags = set(" ".join(re.findall(r"^flags\s*:\s*(.+)$", info, re.MULTILINE)).split())
        return cls(
            cpu=names[0].strip() if names else platform.processor() or platform.machine(),
            flags=tuple(flag for flag in RELEVANT_FLAGS if flag in flags),
            usable_cores=available_cores(),
            memory_gib=psutil.virtual_memory().total / 2**30,
            gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        )

    @property
    def slug(self) -> str:
        """A file-name part naming the machine: its GPU when it has one, else its CPU."""
        name = (self.gpu or self.cpu).lower()
        return re.sub(r"[^a-z0-9]+", "-", re.sub(r"\(r\)|\(tm\)|cpu|processor|@.*", "", name)).strip("-")


def synthetic_batch(
    batch_s: float,
    settings: TrainingSettings,
    vocab_size: int,
    *,
    device: torch.device | None = None,
    utterance_s: float = UTTERANCE_S,
    index: int = 0,
) -> dict:
    """A padded batch of ``batch_s`` seconds of random fbank in utterances of ``utterance_s``, their frames
        padded to a multiple of ``train.data.pad_frames_to`` as training pads them, with random transcripts short
        enough for CTC: what :func:`~asrflow.training.step.train_step` takes, as the ``index``-th batch of an epoch
    (which seeds its dropout)."""
    features = settings.features
    frames = int(min(utterance_s, batch_s) / features.frame_shift_s)
    padded = padded_frames(frames, settings.train.data.pad_frames_to)
    count = max(1, int(batch_s // utterance_s))
    generator = torch.Generator().manual_seed(settings.seed + frames)
    out_frames = int(subsampled_lengths(torch.tensor(frames)))
    tokens = max(1, out_frames // 4)
    batch = {
        "features": torch.randn(count, padded, features.num_mel_bins, generator=generator),
        "feature_lens": torch.full((count,), frames, dtype=torch.int64),
        "targets": torch.randint(1, vocab_size, (count, tokens), generator=generator),
        "target_lens": torch.full((count,), tokens, dtype=torch.int64),
        "durations": torch.full((count,), frames * features.frame_shift_s),
        "cut_ids": [f"synthetic-{utterance}" for utterance in range(count)],
    }
    ids = tuple(batch["cut_ids"])
    batch["item"] = BatchItem(
        epoch=0, step_in_epoch=index, micro_index=0, batch_index=index, cut_ids=ids, step_cut_ids=ids
    )
    return {key: value.to(device) if torch.is_tensor(value) and device else value for key, value in batch.items()}


def synthetic_batches(
    batch_s: float, settings: TrainingSettings, vocab_size: int, *, device: torch.device | None = None
) -> list[dict]:
    """:data:`SHAPES` batches of :func:`synthetic_batch`, their utterances spread evenly over 0.75-1.25 x
    :data:`UTTERANCE_S`: as many batch shapes as training meets in a few hundred steps. In a seeded random order,
    as a length-bucketed epoch draws them, so that the few steps of any round mix short and long batches."""
    lengths = [UTTERANCE_S * (0.75 + 0.5 * index / (SHAPES - 1)) for index in range(SHAPES)]
    random.Random(settings.seed).shuffle(lengths)
    return [
        synthetic_batch(batch_s, settings, vocab_size, device=device, utterance_s=length, index=index)
        for index, length in enumerate(lengths)
    ]


class StepRunner:
    """Real optimizer steps (forward, CTC, backward, clipping, AdamW, dropout seeded per batch) of ``settings``'
    model on ``batches`` in turn, in ``precision``: the model and step context built by the run's factory
    (:mod:`asrflow.training.parts`), seeded as a run is."""

    def __init__(self, settings: TrainingSettings, precision: str, batches: list[dict], *, vocab_size: int):
        place = RunPlace.single(batches[0]["features"].device)
        seed_everything(settings.seed)
        self.model = build_run_model(settings, vocab_size=vocab_size, device=place.device).train()
        self.context = build_step_context(settings, self.model, place, precision=precision)
        self.batches, self.steps = batches, 0
        self.step()  # warm-up: kernels chosen, memory mapped

    def step(self) -> tuple[float, float]:
        """One step on the next batch: its audio seconds and wall seconds."""
        batch = self.batches[self.steps % len(self.batches)]
        self.steps += 1
        began = time.perf_counter()
        result = train_step(self.model, [batch], self.context, step_tokens=int(batch["target_lens"].sum()))
        if batch["features"].is_cuda:
            torch.cuda.synchronize()
        return result.audio_seconds, time.perf_counter() - began

    def run_for(self, seconds: float) -> tuple[float, float]:
        """Steps for about ``seconds`` (one at least): the audio seconds and wall seconds they took."""
        audio = spent = 0.0
        while spent < seconds or audio == 0.0:
            step_audio, step_s = self.step()
            audio, spent = audio + step_audio, spent + step_s
        return audio, spent


class MeasuringProcess:
    """A :class:`StepRunner` in a spawned process of its own, set up as the train stage sets itself up to train
    ``settings`` in ``precision`` at ``threads`` torch threads (None: ``train.optim.num_threads``): the malloc
    the stage would preload or tune for that precision (``run.allocator``), its threads and oneDNN's caches
    (:func:`~asrflow.training.assemble.configure_process`). ``batch_s`` seconds of audio a batch."""

    def __init__(self, settings: TrainingSettings, precision: str, *, batch_s: float, vocab_size: int, threads=None):
        optim = replace(
            settings.train.optim, precision=precision, num_threads=threads or settings.train.optim.num_threads
        )
        self.settings = replace(settings, train=replace(settings.train, optim=optim))
        with stage_environment(self.settings):
            context = multiprocessing.get_context("spawn")
            self.pool = context.Pool(1, initializer=_start_runner, initargs=(self.settings, batch_s, vocab_size))

    def run_for(self, seconds: float) -> tuple[float, float]:
        """:meth:`StepRunner.run_for` in the process."""
        return self.pool.apply(_run_for, (seconds,))

    def report(self) -> dict[str, Any]:
        """The process's settings, as :func:`~asrflow.training.assemble.process_report` gives them."""
        return self.pool.apply(_report)

    def close(self) -> None:
        """End the process. Closed and joined, not terminated: a worker ignores SIGTERM when the process that
        started it does."""
        self.pool.close()
        self.pool.join()


@contextmanager
def stage_environment(settings: TrainingSettings) -> Iterator[None]:
    """This process's environment, while a child is started, as the train stage's would be for ``settings``:
    jemalloc preloaded when the stage would re-execute with it (``run.allocator``, ``train.optim.precision``)."""
    optim = settings.train.optim
    library = jemalloc_to_preload(settings.run.allocator, optim.precision)
    saved = dict(os.environ)
    if library is not None and loaded_allocator() is None:
        os.environ.update(environment_with_jemalloc(os.environ, library))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


_RUNNER: StepRunner | None = None


def _start_runner(settings: TrainingSettings, batch_s: float, vocab_size: int) -> None:
    global _RUNNER
    configure_process(settings.train.optim)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches = synthetic_batches(batch_s, settings, vocab_size, device=device)
    _RUNNER = StepRunner(settings, settings.train.optim.precision, batches, vocab_size=vocab_size)


def _run_for(seconds: float) -> tuple[float, float]:
    return _RUNNER.run_for(seconds)


def _report() -> dict[str, Any]:
    return process_report(_RUNNER.context.precision.name)


def compare(runners: dict[Any, MeasuringProcess], seconds: float, rounds: int = 3) -> dict[Any, float]:
    """Each runner's audio seconds per second: steps taken in turns over ``rounds`` rounds of about
    ``seconds / rounds`` each, so that all see the same load; the best round counts (noise only slows)."""
    best = dict.fromkeys(runners, 0.0)
    for _ in range(rounds):
        for name, runner in runners.items():
            audio, spent = runner.run_for(seconds / rounds)
            best[name] = max(best[name], audio / spent)
    return best


def compare_in_processes(settings: TrainingSettings, cases: dict[Any, dict], seconds: float, **batches) -> dict:
    """:func:`compare` of one :class:`MeasuringProcess` per case (``cases``: name to its ``precision`` and
    ``threads``), each closed at the end; ``batches``: ``batch_s`` and ``vocab_size``."""
    runners = {name: MeasuringProcess(settings, **case, **batches) for name, case in cases.items()}
    try:
        reports = {name: runner.report() for name, runner in runners.items()}
        logger.info("measuring processes, set up as the train stage: %s", reports)
        return compare(runners, seconds * len(runners))
    finally:
        for runner in runners.values():
            runner.close()


#: Batch sizes (seconds of audio) whose steps' peaks give the memory a batch second takes.
MEMORY_BATCHES_S = (SPEED_BATCH_S / 4, SPEED_BATCH_S, 2 * SPEED_BATCH_S)


def peak_memory_mb(settings: TrainingSettings, *, vocab_size: int) -> dict[float, float]:
    """The peak memory (MB) of one training step at each of :data:`MEMORY_BATCHES_S`, in params.yaml's
    precision: allocated memory on a GPU, the resident set's high-water mark of a fresh process, set up as the
    train stage, on the CPU."""
    if torch.cuda.is_available():
        return {batch_s: _peak_mb(settings, vocab_size, batch_s) for batch_s in MEMORY_BATCHES_S}
    # each batch size in a fresh process: its high-water mark is that step's alone
    with stage_environment(settings), multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        peaks = pool.starmap(_peak_mb, [(settings, vocab_size, batch_s) for batch_s in MEMORY_BATCHES_S])
        # the workers end on their own: the block's terminate() ends them with SIGTERM, which they ignore
        # when the process that started them does
        pool.close()
        pool.join()
    return dict(zip(MEMORY_BATCHES_S, peaks, strict=True))


def _peak_mb(settings: TrainingSettings, vocab_size: int, batch_s: float) -> float:
    cuda = torch.cuda.is_available()
    if not cuda:
        configure_process(settings.train.optim)
    batch = synthetic_batch(batch_s, settings, vocab_size, device=torch.device("cuda" if cuda else "cpu"))
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    StepRunner(settings, settings.train.optim.precision, [batch], vocab_size=vocab_size)  # one step
    if cuda:
        return torch.cuda.max_memory_allocated() / 2**20
    # VmHWM, not ru_maxrss: the latter is kept across the exec that started this process, so it would
    # include the parent's resident set
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE).group(1)) / 2**10


def largest_batch_s(settings: TrainingSettings, *, vocab_size: int) -> tuple[float, dict]:
    """The largest batch (seconds of audio) whose step fits in :data:`MEMORY_SHARE` of the memory free now
    (memory grows linearly with the batch: the slope between the two largest measured batches), and the
    figures it came from."""
    peaks = peak_memory_mb(settings, vocab_size=vocab_size)
    (middle, middle_mb), (large, large_mb) = sorted(peaks.items())[-2:]
    per_second = max((large_mb - middle_mb) / (large - middle), 0.01)
    fixed = large_mb - per_second * large
    if torch.cuda.is_available():
        free_mb = torch.cuda.mem_get_info()[0] / 2**20
    else:
        free_mb = psutil.virtual_memory().available / 2**20
    largest = max(UTTERANCE_S, (MEMORY_SHARE * free_mb - fixed) / per_second)
    return largest, {"peak_mb": peaks, "mb_per_batch_second": per_second, "free_mb": free_mb}


def worker_rate(settings: TrainingSettings, *, seconds: float) -> float:
    """Audio seconds per second one data worker turns into fbank (one thread, as a worker runs), with the
    speed perturbation ``train.data`` asks for."""
    from asrflow.data.loading.augment import SPEED_FACTORS

    features = settings.features
    extractor = features.extractor()
    generator = torch.Generator().manual_seed(settings.seed)
    audio = torch.randn(int(UTTERANCE_S * features.sampling_rate), generator=generator).numpy() * 0.1
    factors = SPEED_FACTORS if settings.train.data.speed_perturb else (1.0,)
    import torchaudio.functional as audio_functional

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        done, began = 0.0, time.perf_counter()
        while time.perf_counter() - began < seconds or done == 0.0:
            for factor in factors:
                samples = audio
                if factor != 1.0:
                    rate = int(features.sampling_rate * factor)
                    samples = audio_functional.resample(torch.from_numpy(audio), rate, features.sampling_rate).numpy()
                extractor.extract(samples, features.sampling_rate)
                done += UTTERANCE_S / factor
        return done / (time.perf_counter() - began)
    finally:
        torch.set_num_threads(previous)


def thread_candidates(cores: int) -> list[int]:
    """1, 2, 4, ... up to ``cores``, and ``cores`` itself."""
    counts = [2**power for power in range(int(math.log2(max(cores, 1))) + 1)]
    return sorted(set(counts) | {cores})


def precision_candidates(requested: str) -> list[str]:
    """fp32 and bf16; fp16 (with its gradient scaler) too on a GPU, where it has fast kernels; and what
    ``requested`` (``train.optim.precision``) resolves to here, so that it is measured too."""
    candidates = ["fp32", "bf16", "fp16"] if torch.cuda.is_available() else ["fp32", "bf16"]
    current = resolved_precision(requested)
    return candidates if current in candidates else [*candidates, current]


def resolved_precision(requested: str) -> str:
    """The precision ``requested`` trains in on this machine (``auto`` resolved)."""
    return precision_for(requested, torch.device("cuda" if torch.cuda.is_available() else "cpu")).name


def chosen_precision(by_precision: dict[str, float], current: str) -> str:
    """The fastest of ``by_precision`` (audio-s/s by precision) when it beats ``current`` by :data:`MIN_GAIN`,
    else ``current``."""
    best = max(by_precision, key=by_precision.get)
    return best if by_precision[best] >= MIN_GAIN * by_precision[current] else current


def measure_machine(settings: TrainingSettings, *, vocab_size: int, seconds: float) -> dict[str, Any]:
    """Every figure :func:`choose` decides from; ``seconds`` is spent on each speed measurement."""
    batch_s = min(settings.train.data.max_duration_s, SPEED_BATCH_S)
    batches = {"batch_s": batch_s, "vocab_size": vocab_size}
    figures: dict[str, Any] = {"speed_batch_s": batch_s, "precision_audio_s_per_s": {}, "threads_audio_s_per_s": {}}
    threads = settings.train.optim.num_threads
    cases = {p: {"precision": p, "threads": threads} for p in precision_candidates(settings.train.optim.precision)}
    figures["precision_audio_s_per_s"] = by_precision = compare_in_processes(settings, cases, seconds, **batches)
    logger.info("at %d thread(s): %s", threads, _figures(by_precision))
    if not torch.cuda.is_available():  # threads in the precision the preset will train in
        precision = chosen_precision(by_precision, resolved_precision(settings.train.optim.precision))
        cases = {t: {"precision": precision, "threads": t} for t in thread_candidates(available_cores())}
        figures["threads_audio_s_per_s"] = compare_in_processes(settings, cases, seconds, **batches)
        figures["threads_precision"] = precision
        logger.info("%s by threads: %s", precision, _figures(figures["threads_audio_s_per_s"]))
    if settings.features.on_the_fly:
        figures["worker_audio_s_per_s"] = worker_rate(settings, seconds=seconds / 2)
    figures["largest_batch_s"], figures["memory"] = largest_batch_s(settings, vocab_size=vocab_size)
    return figures


def choose(settings: TrainingSettings, figures: dict[str, Any], *, cores: int) -> dict[str, Any]:
    """The overrides (dotted keys) of params.yaml that :func:`measure_machine` found better on a machine of ``cores``
    usable cores."""
    optim, chosen = settings.train.optim, {}
    by_precision = figures["precision_audio_s_per_s"]
    current = resolved_precision(optim.precision)
    if (precision := chosen_precision(by_precision, current)) != current:
        chosen["train.optim.precision"] = precision
    by_threads = figures["threads_audio_s_per_s"]
    if by_threads:
        threads = max(by_threads, key=by_threads.get)
        baseline = by_threads.get(optim.num_threads)
        if threads != optim.num_threads and (baseline is None or by_threads[threads] >= MIN_GAIN * baseline):
            chosen["train.optim.num_threads"] = threads
    if "worker_audio_s_per_s" in figures:
        step = max(by_threads.values()) if by_threads else max(by_precision.values())
        needed = math.ceil(1.2 * step / figures["worker_audio_s_per_s"])  # 20 % ahead of the step
        spare = max(1, cores - chosen.get("train.optim.num_threads", optim.num_threads))
        workers = min(needed, spare)
        if workers != settings.run.data_workers(True, usable_cores=cores):
            chosen["run.num_workers"] = workers
    if figures["largest_batch_s"] < settings.train.data.max_duration_s:
        chosen["train.data.max_duration_s"] = float(math.floor(figures["largest_batch_s"]))
    return chosen


def preset_text(chosen: dict[str, Any], machine: Machine, figures: dict[str, Any], params_path: Path) -> str:
    """The preset file: a header naming the machine and the figures, then the overrides as sections."""
    import yaml

    from asrflow.params import nested

    when = datetime.now(UTC).strftime("%Y-%m-%d")
    header = [
        f"# Measured on this machine by `python -m asrflow.training.tune --params {params_path}` on {when}",
        f"# (torch {torch.__version__}): {machine.cpu}; flags {' '.join(machine.flags) or 'none of note'};",
        f"# {machine.usable_cores} usable cores, {machine.memory_gib:.0f} GiB; GPU {machine.gpu or 'none'}.",
        "# Apply it: python -m asrflow.presets <this file>.",
        f"# Figures, audio-s/s of training steps on {figures['speed_batch_s']:g} s batches of {SHAPES} shapes:",
        f"#   by precision: {_figures(figures['precision_audio_s_per_s'])}",
    ]
    if figures["threads_audio_s_per_s"]:
        header.append(
            f"#   by torch threads, {figures['threads_precision']}: {_figures(figures['threads_audio_s_per_s'])}"
        )
    if "worker_audio_s_per_s" in figures:
        header.append(f"#   one data worker's fbank: {figures['worker_audio_s_per_s']:.0f}")
    header.append(f"#   largest batch that fits: {figures['largest_batch_s']:.0f} s of audio")
    return "\n".join(header) + "\n" + yaml.safe_dump(nested(chosen), sort_keys=False)


def _figures(values: dict) -> str:
    return ", ".join(f"{key} {value:.1f}" for key, value in values.items())


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help="params file (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="preset to write (default: presets/machine-<cpu or gpu>.yaml)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per speed measurement (default 3)")
    args = parser.parse_args(argv)
    setup_logging()
    settings = TrainingSettings.from_params(load_params(args.params))
    vocab_size = int(settings.params.get("tokenizer", {}).get("vocab_size", 32))
    machine = Machine.here()
    logger.info("measuring %s (%d cores, GPU %s)", machine.cpu, machine.usable_cores, machine.gpu or "none")
    figures = measure_machine(settings, vocab_size=vocab_size, seconds=args.seconds)
    chosen = choose(settings, figures, cores=machine.usable_cores)
    out = args.out or Path("presets") / f"machine-{machine.slug}.yaml"
    if not chosen:
        print(f"params.yaml's settings are already the best measured here ({machine.cpu}); nothing written")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(preset_text(chosen, machine, figures, args.params))
    print(f"wrote {out}: {', '.join(f'{key}: {value}' for key, value in chosen.items())}")
    print(f"apply it with: python -m asrflow.presets {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
