"""The ``asrflow`` command: one front door for everything a user runs by hand.

``asrflow corpus PATH``
    What a corpus holds and what prepare would make of it (:mod:`asrflow.data.prepare.corpus_report`).
``asrflow preset FILE``
    Apply a preset to params.yaml (:func:`asrflow.presets.main`).
``asrflow tune``
    Measure this machine and write its preset (:func:`asrflow.training.tune.main`).
``asrflow transcribe`` / ``asrflow export``
    Use a trained model bundle (:func:`asrflow.serving.cli.main`).
``asrflow --version``
    The installed version.

The pipeline itself runs through ``snakemake`` or ``dvc``, and runs are browsed with ``mlflow ui`` (the
epilog of ``--help``). The ``python -m`` paths of each module stay for scripts.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from asrflow.errors import EXIT_USER_ERROR

#: Exit code of ``asrflow corpus`` when nothing is usable (asrflow.data.prepare.corpus_report.EXIT_NOTHING_USABLE,
#: repeated so that ``--help`` answers without importing Lhotse; a test holds them equal).
EXIT_CORPUS_NOT_USABLE = 3

#: The subcommands handed to another module's ``main``, with their line in ``--help``.
DELEGATED = {
    "preset": "apply a preset (presets/*.yaml) to params.yaml, keeping its comments",
    "tune": "measure this machine's training speed and write presets/machine-<cpu or gpu>.yaml",
    "transcribe": "print the transcript of each audio file with a trained model (exp/model.pt)",
    "export": "export a trained model's encoder to ONNX or TorchScript",
}

EPILOG = """\
the pipeline (stages in dvc.yaml / workflow/Snakefile, settings in params.yaml):
  snakemake --cores all             run the pipeline (or: dvc repro)
  dvc exp run -S key=value          an experiment: the pipeline with one setting changed
  mlflow ui --backend-store-uri sqlite:///mlflow.db
                                    browse the runs, their metrics and models

Run 'asrflow COMMAND --help' for a command's options."""


def build_parser_front_door() -> argparse.ArgumentParser:
    """The ``asrflow`` parser: ``corpus`` in full, the delegated commands by name (their own parsers answer)."""
    parser = argparse.ArgumentParser(
        prog="asrflow",
        description="asrflow: a speech-recognition training pipeline. Look at a corpus, set params, tune to "
        "this machine, and use the trained model.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="store_true", help="print asrflow's version and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    corpus = commands.add_parser(
        "corpus",
        help="report what a corpus holds and what prepare would reject, and suggest its params (writes nothing)",
        description="Read a corpus as prepare reads it, without writing anything, and print: items, hours, a "
        "duration histogram, sampling rates and channel counts, the transcripts' characters and out-of-place "
        "words, what prepare would reject and why (prepare's own checks, with params.yaml's prepare rules), each "
        "problem with the setting that handles it, and the params to use (the prepare section, "
        "features.sampling_rate, the preset for the corpus' size and this machine's).",
        epilog="formats (as prepare reads them, see docs/data.md):\n"
        "  folder  <PATH>/<split>.tsv: relative/path.wav<TAB>transcript[<TAB>speaker]\n"
        "  kaldi   <PATH>/<split>/wav.scp and text (optional segments, utt2spk)\n"
        "  recipe  a Lhotse recipe, --recipe NAME (lhotse.recipes.prepare_NAME on PATH)\n"
        "  auto    folder when PATH holds *.tsv, kaldi when a sub-folder holds wav.scp\n\n"
        "exit status:\n"
        "  0  something is usable (the problems found are reported)\n"
        f"  {EXIT_CORPUS_NOT_USABLE}  nothing is usable: an empty folder, no transcripts, every train item rejected\n"
        "  2  PATH is not a folder, or a bad params file or recipe",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    corpus.add_argument("path", type=Path, metavar="PATH", help="the corpus folder (prepare.corpus_dir)")
    corpus.add_argument(
        "--format",
        dest="corpus_format",
        choices=("auto", "folder", "kaldi", "recipe"),
        default="auto",
        help="how to read it: sets prepare.corpus (default: %(default)s)",
    )
    corpus.add_argument("--recipe", metavar="NAME", help="a Lhotse recipe's name, for --format recipe (prepare.corpus)")
    corpus.add_argument(
        "--params",
        type=Path,
        default=Path("params.yaml"),
        help="params file whose prepare rules are applied, and which --write changes (default: %(default)s)",
    )
    corpus.add_argument(
        "--write",
        action="store_true",
        help="apply the suggested prepare.corpus, prepare.corpus_dir, prepare.splits and features.sampling_rate "
        "to --params (comments kept)",
    )
    for name, line in DELEGATED.items():
        commands.add_parser(name, help=line, add_help=False)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("asrflow")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


@contextlib.contextmanager
def _program_name(name: str) -> Iterator[None]:
    """``sys.argv[0]`` set to ``name`` meanwhile: argparse's ``prog`` of a parser built without one."""
    saved = sys.argv[0] if sys.argv else ""
    if not sys.argv:
        sys.argv.append(saved)
    sys.argv[0] = name
    try:
        yield
    finally:
        sys.argv[0] = saved


def _delegate(command: str, rest: list[str], verbose: bool) -> int:
    """Run ``command`` by the ``main`` of its module; its exit code (``None`` from a main is 0)."""
    target: Callable[[list[str]], int | None]
    if command in ("transcribe", "export"):
        from asrflow.serving.cli import main as serving_main

        return int(serving_main([*(["-v"] if verbose else []), command, *rest]) or 0)
    if command == "preset":
        from asrflow.presets import main as target
    else:
        from asrflow.training.tune import main as target
    with _program_name(f"asrflow {command}"):
        try:
            return int(target(rest) or 0)
        except SystemExit as stop:  # argparse's --help and usage errors, exit_on_user_error
            return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else EXIT_USER_ERROR)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``asrflow`` command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = False
    while argv and argv[0] in ("-v", "--verbose"):
        verbose, argv = True, argv[1:]
    if argv and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:], verbose)
    parser = build_parser_front_door()
    args = parser.parse_args(argv)
    if args.version:
        print(f"asrflow {_version()}")
        return 0
    if args.command is None:
        parser.print_help()
        return EXIT_USER_ERROR
    if verbose or args.verbose:
        from asrflow.logs import setup_logging

        setup_logging(logging.INFO)
    from asrflow.data.prepare.corpus_report import inspect_corpus
    from asrflow.serving.cli import exit_code_of

    options = {"corpus_format": args.corpus_format, "recipe": args.recipe, "params": args.params, "write": args.write}
    return exit_code_of(lambda: inspect_corpus(args.path, **options))


if __name__ == "__main__":
    sys.exit(main())
