"""``asrflow transcribe`` on long recordings: peak memory and real-time factor against the recording's length.

``python -m bench.long_audio [--quick] [--workdir DIR] [--minutes 1 10 60] [--chunk-s S] [--overlap-s S]``: for
each length, a recording of generated speech (yesno test files, 8 kHz, joined in turn with 1 s of low noise
between them, written block by block) is transcribed by ``asrflow transcribe`` in a child process of its own
(``--device cpu``); the child's peak RSS comes from ``os.wait4``. The model is ``exp/model.pt``, else the one
:func:`bench.decode_rtf.model_bundle` gives (``--quick``: untrained, so its WER means nothing). ``--quick``
measures 0.5, 2 and 5 minutes.

Records ``long_audio`` per length: ``minutes``, ``audio_s``, ``peak_rss_mb``, ``wall_s``, ``rtf`` (wall over
audio), ``rtf_decoding`` (wall less a run on 1 s of audio, i.e. without start-up and model loading), ``wer``
against the joined references, and ``rss_vs_first`` (peak RSS over the shortest recording's). One more record,
``decoded: whole`` (``--chunk-s`` above the length), gives the shortest recording decoded in one piece.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import emit, load_average, machine, parse_args, ratio, workdir
from bench.decode_rtf import model_bundle
from tests.support.corpora import yesno_data
from tests.support.repo import REPO

MINUTES = {"full": [1.0, 10.0, 60.0], "quick": [0.5, 2.0, 5.0]}
GAP_S = 1.0


def write_long_speech(data: Path, out: Path, minutes: float) -> tuple[str, float]:
    """Write ``minutes`` of yesno test files joined with :data:`GAP_S` of noise to ``out`` (WAV), a file at a
    time; its joined reference and its length in seconds."""
    import soundfile as sf

    from tests.support.trained_model import split_files

    files = split_files(data)
    rng = np.random.default_rng(0)
    refs, samples, rate = [], 0, sf.info(str(files[0][0])).samplerate
    with sf.SoundFile(out, "w", samplerate=rate, channels=1, subtype="PCM_16") as sink:
        for index in range(10**6):
            path, text = files[index % len(files)]
            audio = sf.read(path, dtype="float32")[0]
            if samples:
                noise = rng.normal(0, audio[: rate // 2].std(), int(GAP_S * rate)).astype(np.float32)
                sink.write(noise)
                samples += len(noise)
            sink.write(audio)
            samples += len(audio)
            refs.append(text)
            if samples >= minutes * 60 * rate:
                break
    return " ".join(refs), samples / rate


def transcribe_child(model: Path, audio: Path, options: list[str]) -> tuple[float, float, str]:
    """Wall seconds, peak RSS (MB) and stdout of ``asrflow transcribe`` on ``audio`` in a child process."""
    command = [sys.executable, "-m", "asrflow.serving.cli", "transcribe", "--model", str(model), "--device", "cpu"]
    start = time.perf_counter()
    child = subprocess.Popen([*command, *options, str(audio)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"asrflow transcribe exited {child.returncode} on {audio}")
    return wall, usage.ru_maxrss / 1024, out


def word_error_rate(ref: str, hyp: str) -> float:
    """WER in points of ``hyp`` against ``ref``, by asrflow's own scorer (kaldialign's alignment)."""
    from asrflow.evaluation.metrics import score_corpus

    return 100.0 * score_corpus({"recording": ref}, {"recording": hyp}).wer


def _configure(parser) -> None:
    parser.add_argument("--minutes", type=float, nargs="+", help="recording lengths (default: 1 10 60)")
    parser.add_argument("--chunk-s", type=float, default=30.0, help="transcribe --chunk-s (default: %(default)s)")
    parser.add_argument("--overlap-s", type=float, default=4.0, help="transcribe --overlap-s (default: %(default)s)")


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(__doc__.splitlines()[0], argv, _configure)
    mode = "quick" if args.quick else "full"
    options = ["--chunk-s", str(args.chunk_s), "--overlap-s", str(args.overlap_s)]
    records: list[dict] = []
    with workdir(args.workdir) as work:
        data = yesno_data(work)
        model, source = model_bundle(data, work, args.quick)
        write_long_speech(data, work / "startup.wav", 1 / 60)
        startup_wall = transcribe_child(model, work / "startup.wav", options)[0]
        base = {"benchmark": "long_audio", "mode": mode, "model": source, "chunk_s": args.chunk_s}
        base |= {"overlap_s": args.overlap_s, "startup_wall_s": startup_wall, "machine": machine()}
        runs = [(minutes, "chunked") for minutes in args.minutes or MINUTES[mode]]
        for minutes, decoded in [*runs, (runs[0][0], "whole")]:
            audio = work / f"long-{minutes:g}min.wav"
            ref, seconds = write_long_speech(data, audio, minutes)
            chosen = options if decoded == "chunked" else ["--chunk-s", str(10 * seconds)]
            wall, rss, out = transcribe_child(model, audio, chosen)
            hyp = out.rstrip("\n").split("\t", 1)[1] if "\t" in out else ""
            record = base | {"decoded": decoded, "minutes": minutes, "audio_s": seconds, "peak_rss_mb": rss}
            record |= {"wall_s": wall, "rtf": wall / seconds, "rtf_decoding": (wall - startup_wall) / seconds}
            record |= {"wer": word_error_rate(ref, hyp), "load_average": load_average()}
            record["rss_vs_first"] = ratio(rss, records[0]["peak_rss_mb"]) if records else 1.0
            records.append(emit(record))
            audio.unlink()
    return records


if __name__ == "__main__":
    main()
