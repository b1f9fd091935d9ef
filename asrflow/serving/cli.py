"""The ``asrflow`` command: use a trained model bundle (``exp/model.pt``) outside the pipeline.

Subcommands:

``asrflow transcribe --model exp/model.pt [--decoder greedy|beam] [--output text|json|srt|vtt] [--out DIR] AUDIO...``
    Prints ``<path><TAB><transcript>`` per audio file, in the order given. Any format and
    sample rate Lhotse reads works (WAV, FLAC, ...); multi-channel audio is averaged to
    mono and everything is resampled to the model's rate. A file that cannot be
    transcribed gets one ``error:`` line on stderr naming it; the others still are.
    ``--output json`` prints one JSON object per file instead (``path``, ``text``, ``words``
    with start and end seconds, ``segments``); ``srt`` and ``vtt`` print subtitles, one cue
    per segment (:mod:`asrflow.decoding.timing` places the words). With ``--out DIR`` each
    file's output goes to ``DIR/<stem>.txt|.json|.srt|.vtt`` and stdout names it. A file
    longer than ``--chunk-s`` seconds is decoded in overlapping windows, in memory that
    does not grow with its length (:mod:`asrflow.serving.chunking`).

``asrflow export --model exp/model.pt --format onnx|torchscript --out FILE``
    Writes the encoder (normalised fbank in, CTC log-probabilities out) for serving; see
    :mod:`asrflow.serving.export`.

Exit codes: 0 success; 1 some audio files failed (the rest were transcribed); 2 a usage
error or a problem with the model file (nothing was done).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from asrflow.errors import EXIT_USER_ERROR, AsrflowError, first_line
from asrflow.serving.subtitles import OUTPUT_SUFFIXES

#: Choices of --decoder and export --format (asrflow.decoding.ctc.DECODER_KINDS and asrflow.serving.export.FORMATS;
#: repeated here so that ``--help`` answers without importing torch).
DECODERS = ("greedy", "beam")
EXPORT_FORMATS = ("onnx", "torchscript")
#: Defaults of --chunk-s and --overlap-s (asrflow.serving.chunking.CHUNK_S and OVERLAP_S, repeated for --help).
CHUNK_S = 30.0
OVERLAP_S = 4.0

#: Exit code when at least one audio file could not be transcribed.
EXIT_SOME_FILES_FAILED = 1

logger = logging.getLogger(__name__)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``asrflow`` argument parser with one sub-parser per command."""
    parser = argparse.ArgumentParser(
        prog="asrflow",
        description="Use a trained asrflow model: transcribe audio files or export the model for serving.",
        epilog="Run 'asrflow COMMAND --help' for a command's options. Train a model first with "
        "'snakemake --cores all' (or 'dvc repro'); it is written to exp/model.pt.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    transcribe = commands.add_parser(
        "transcribe",
        help="print the transcript of each audio file",
        description="Transcribe audio files with a model bundle.\n\n"
        "Prints one line per file, '<path><TAB><transcript>', in the order given. Any format\n"
        "and sample rate Lhotse reads works (WAV, FLAC, ...): multi-channel audio is averaged\n"
        "to mono and resampled to the model's rate. Files are decoded in batches of up to\n"
        "--batch-seconds of audio.",
        epilog="A file that cannot be read (missing, empty, corrupt, too short) gets one 'error:'\n"
        "line on stderr naming it, and the other files are still transcribed.\n\n"
        "exit status:\n"
        "  0  every file was transcribed\n"
        "  1  at least one file failed (the others were transcribed)\n"
        "  2  usage error, or the model file is missing or unusable\n\n"
        "examples:\n"
        "  asrflow transcribe --model exp/model.pt a.wav b.flac > transcripts.tsv\n"
        "  asrflow transcribe --model exp/model.pt --output json a.wav > a.json    # word and segment times\n"
        "  asrflow transcribe --model exp/model.pt --output srt --out subs/ a.wav b.flac",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    transcribe.add_argument("--model", required=True, type=Path, help="model bundle written by training")
    transcribe.add_argument(
        "--decoder",
        choices=DECODERS,
        default="greedy",
        help="CTC decoding: best token per frame, or prefix beam search (default: %(default)s)",
    )
    transcribe.add_argument(
        "--beam-size", type=_positive_int, default=8, help="hypotheses kept by --decoder beam (default: %(default)s)"
    )
    transcribe.add_argument(
        "--lm", type=Path, default=None, help="KenLM n-gram over tokens for --decoder beam (see asrflow.decoding.ctc)"
    )
    transcribe.add_argument(
        "--lm-weight", type=float, default=0.5, help="weight of --lm's log10-probabilities (default: %(default)s)"
    )
    transcribe.add_argument(
        "--word-score", type=float, default=0.0, help="score added per word with --lm (default: %(default)s)"
    )
    transcribe.add_argument(
        "--batch-seconds",
        type=_positive_float,
        default=60.0,
        help="seconds of audio decoded together; a longer file goes alone (default: %(default)s)",
    )
    transcribe.add_argument(
        "--chunk-s",
        type=_positive_float,
        default=CHUNK_S,
        help="window length in seconds: a longer file is decoded in overlapping windows of this length, in "
        "memory that does not grow with its length; a file no longer than this is decoded whole "
        "(default: %(default)s)",
    )
    transcribe.add_argument(
        "--overlap-s",
        type=_non_negative_float,
        default=OVERLAP_S,
        help="seconds shared by consecutive windows of --chunk-s; each keeps its half, so every decoded frame "
        "has at least half of this of context either side (default: %(default)s)",
    )
    transcribe.add_argument(
        "--device",
        default="auto",
        help="where the encoder runs: auto (a CUDA GPU when there is one, else the CPU), cpu, cuda or cuda:N "
        "(default: %(default)s)",
    )
    transcribe.add_argument(
        "--output",
        choices=tuple(OUTPUT_SUFFIXES),
        default="text",
        help="text: '<path><TAB><transcript>' lines; json: one object per file with word and segment times; "
        "srt, vtt: subtitles, one cue per segment (one AUDIO, or --out) (default: %(default)s)",
    )
    transcribe.add_argument(
        "--out", type=Path, default=None, help="folder to write <stem>.txt|.json|.srt|.vtt per file in, not stdout"
    )
    transcribe.add_argument(
        "--max-pause",
        type=_positive_float,
        default=0.5,
        help="a pause between words longer than this many seconds starts a new segment (default: %(default)s)",
    )
    transcribe.add_argument("audio", nargs="+", metavar="AUDIO", help="audio files to transcribe")
    transcribe.set_defaults(handler=run_transcribe)

    export = commands.add_parser(
        "export",
        help="export the model's encoder to ONNX or TorchScript",
        description="Export the encoder of a model bundle for serving without asrflow.\n\n"
        "inputs:  features  (N, T, F) float32, fbank normalised with the bundle's CMVN\n"
        "         lengths   (N,) int64, valid frames per utterance\n"
        "outputs: log_probs (N, T', V) float32, CTC log-probabilities (blank = 0)\n"
        "         out_lens  (N,) int64, valid output frames (40 ms each)\n"
        "N and T are dynamic. Token pieces, feature settings and CMVN statistics are stored\n"
        "in the file as JSON metadata (ONNX metadata_props, TorchScript extra files).",
        epilog="example:\n  asrflow export --model exp/model.pt --format onnx --out exp/model.onnx",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_argument("--model", required=True, type=Path, help="model bundle written by training")
    export.add_argument("--format", required=True, choices=EXPORT_FORMATS, help="what to write")
    export.add_argument("--out", required=True, type=Path, help="file to write (replaced atomically)")
    export.set_defaults(handler=run_export)
    return parser


# ---------------------------------------------------------------- transcribe
def _long_files(bundle, paths: Sequence[str], chunk: tuple[float, float] | None) -> dict[int, object]:
    """Index -> :class:`asrflow.serving.chunking.WindowPlan` of each path longer than one window (``chunk`` is
    ``(chunk_s, overlap_s)``; ``None`` decodes every file whole)."""
    if chunk is None:
        return {}
    from asrflow.decoding.timing import output_frame_seconds
    from asrflow.serving.chunking import plan_windows

    frame_s = output_frame_seconds(bundle.features.frame_shift_s)
    plans = {index: plan_windows(path, frame_s, *chunk) for index, path in enumerate(paths)}
    return {index: plan for index, plan in plans.items() if plan is not None}


def _chunked(bundle, path: str, plan, decode, *, max_pause_s: float | None) -> tuple[str | dict | None, str | None]:
    """``(transcript, None)`` of a long file decoded in windows, or ``(None, error message)``."""
    from asrflow.serving.chunking import chunked_transcript

    logger.info("%s: %.1f s of audio in %d windows", path, plan.samples / plan.rate, plan.count)
    try:
        return chunked_transcript(bundle, path, plan, decode, max_pause_s=max_pause_s), None
    except Exception as error:
        logger.debug("chunked decoding of %s failed", path, exc_info=True)
        return None, f"{path}: could not be transcribed ({first_line(error)})"


def _decode_batch(transcripts, bundle, batch: list, decode, *, paths: Sequence[str]) -> dict:
    """Index -> ``(transcript, None)`` or ``(None, message)`` of a batch; a failed batch is retried file by file,
    so one bad file only costs its own transcript."""
    try:
        texts = transcripts(bundle, [cut for _, cut in batch], decode)
        return {index: (text, None) for (index, _), text in zip(batch, texts, strict=True)}
    except Exception:
        logger.debug("a batch failed; retrying its files one by one", exc_info=True)
    done = {}
    for index, cut in batch:
        try:
            done[index] = (transcripts(bundle, [cut], decode)[0], None)
        except Exception as error:
            done[index] = (None, f"{paths[index]}: could not be transcribed ({first_line(error)})")
    return done


def transcribe_files(
    bundle,
    paths: Sequence[str],
    decode,
    batch_seconds: float = 60.0,
    *,
    max_pause_s: float | None = None,
    chunk: tuple[float, float] | None = None,
) -> Iterator[tuple[str, str | dict | None, str | None]]:
    """Transcribe ``paths`` with ``bundle`` and ``decode`` (a :data:`asrflow.decoding.ctc.Decoder`).

    Yields ``(path, transcript, None)`` or ``(path, None, error message)`` per path, in
    input order, each as soon as it and every path before it are done. A batch that fails
    as a whole is retried file by file, so one bad file only costs its own transcript.
    With ``max_pause_s`` set, a transcript is :func:`asrflow.serving.inference.timed_transcripts`'s
    ``{text, words, segments}`` (segments split at pauses over it), else the text. With ``chunk``
    (``(chunk_s, overlap_s)``) a file longer than ``chunk_s`` seconds is decoded alone in overlapping windows
    (:mod:`asrflow.serving.chunking`), never held whole.
    """
    from asrflow.data.manifests import pack_shortest_first
    from asrflow.serving.inference import read_audio, timed_transcripts

    if max_pause_s is None:
        from asrflow.serving.inference import transcripts
    else:

        def transcripts(bundle, cuts, decode):
            return timed_transcripts(bundle, cuts, decode, max_pause_s)

    long = _long_files(bundle, paths, chunk)
    short = [index for index in range(len(paths)) if index not in long]
    done: dict[int, tuple[str | dict | None, str | None]] = {}
    readable: list[tuple[int, object]] = []
    for index, (cut, message) in zip(short, read_audio([paths[index] for index in short]), strict=True):
        if cut is None:
            done[index] = (None, message)
        else:
            readable.append((index, cut))

    next_index = 0
    # Shortest first keeps padding small: an utterance's output depends a little on it.
    batches = pack_shortest_first(readable, lambda item: item[1].duration, batch_seconds)
    for number, batch in enumerate([*batches, []], start=1):
        while next_index in done or next_index in long:
            if next_index in long:
                done[next_index] = _chunked(
                    bundle, paths[next_index], long.pop(next_index), decode, max_pause_s=max_pause_s
                )
            yield paths[next_index], *done.pop(next_index)
            next_index += 1
        if batch:
            seconds = sum(cut.duration for _, cut in batch)
            logger.info("batch %d/%d: %d files, %.1f s of audio", number, len(batches), len(batch), seconds)
            done.update(_decode_batch(transcripts, bundle, batch, decode, paths=paths))


def _output_files(args: argparse.Namespace) -> list[Path] | None:
    """Where ``--out`` puts each AUDIO's output (``None`` for stdout); refuses what cannot be written."""
    if args.out is None:
        if args.output in ("srt", "vtt") and len(args.audio) > 1:
            raise AsrflowError(f"--output {args.output} prints one file's subtitles; name --out DIR for several files")
        return None
    if args.out.exists() and not args.out.is_dir():
        raise AsrflowError(f"--out {args.out} is a file; name a folder (it is created if missing)")
    files = [args.out / (Path(path).stem + OUTPUT_SUFFIXES[args.output]) for path in args.audio]
    clashes = sorted({str(file) for file in files if files.count(file) > 1})
    if clashes:
        raise AsrflowError(f"--out: several AUDIO files would write {clashes[0]}; give the files different names")
    return files


def _emit(args: argparse.Namespace, path: str, transcript, file: Path | None) -> None:
    """Print or write one file's transcript as ``--output`` asks."""
    from asrflow.files import atomic_path
    from asrflow.serving.subtitles import render_transcript

    if args.output == "text" and file is None:
        print(f"{path}\t{transcript}", flush=True)
        return
    if isinstance(transcript, str):  # --output text: no times were computed
        transcript = {"text": transcript}
    rendered = render_transcript(transcript, args.output, path)
    if file is None:
        print(rendered, end="", flush=True)
        return
    with atomic_path(file) as tmp:
        tmp.write_text(rendered, encoding="utf-8")
    print(f"{path}\t{file}", flush=True)


def run_transcribe(args: argparse.Namespace) -> int:
    """``asrflow transcribe``: print or write transcripts, report bad files; return the exit code."""
    from asrflow.decoding.ctc import build_decoder
    from asrflow.serving.bundle import load_bundle
    from asrflow.serving.device import resolve_device
    from asrflow.tokenizer import BLANK_ID

    if args.lm is not None and args.decoder != "beam":
        raise AsrflowError("--lm needs --decoder beam")
    if args.overlap_s >= args.chunk_s:
        raise AsrflowError(f"--overlap-s ({args.overlap_s}) must be shorter than --chunk-s ({args.chunk_s})")
    files = _output_files(args)
    bundle = load_bundle(args.model, device=resolve_device(args.device, "--device"))
    decode = build_decoder(
        args.decoder,
        tokens=bundle.tokenizer.pieces,
        blank=BLANK_ID,
        beam_size=args.beam_size,
        lm_path=str(args.lm) if args.lm else None,
        lm_weight=args.lm_weight,
        word_score=args.word_score,
    )
    failed = 0
    timed = None if args.output == "text" else args.max_pause
    chunk = (args.chunk_s, args.overlap_s)
    results = transcribe_files(bundle, args.audio, decode, args.batch_seconds, max_pause_s=timed, chunk=chunk)
    for index, (path, transcript, message) in enumerate(results):
        if message is not None:
            failed += 1
            print(f"error: {message}", file=sys.stderr, flush=True)
        else:
            _emit(args, path, transcript, files[index] if files else None)
    if failed:
        print(f"error: {failed} of {len(args.audio)} files could not be transcribed", file=sys.stderr)
        return EXIT_SOME_FILES_FAILED
    return 0


# ---------------------------------------------------------------- export
def run_export(args: argparse.Namespace) -> int:
    """``asrflow export``: write the encoder as ONNX or TorchScript."""
    from asrflow.serving.export import export_model

    out = export_model(args.model, args.format, args.out)
    print(f"wrote {out} ({args.format}, {out.stat().st_size / 1e6:.1f} MB)")
    return 0


#: The exit status of a command interrupted by Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130


def exit_code_of(command: Callable[[], int]) -> int:
    """Run a command-line ``command`` and return its exit status: a user's mistake (:class:`AsrflowError`)
    prints one ``error:`` line and gives 2, Ctrl-C prints ``interrupted`` and gives 130."""
    try:
        return command()
    except AsrflowError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``asrflow`` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.verbose:
        from asrflow.logs import setup_logging

        setup_logging(logging.INFO)
    return exit_code_of(lambda: args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
