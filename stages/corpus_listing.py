"""Stage ``corpus_listing``: list the corpus folder's files (path, size, modification time).

Run from the repository root::

    python -m stages.corpus_listing --params params.yaml --out data/corpus_listing.tsv

``prepare`` depends on this small file instead of the corpus folder, so a run with nothing
to do stats the corpus but never reads or hashes its audio. DVC runs the stage every time
(``always_changed``); Snakemake runs it while reading the workflow (workflow/rules/common.smk).
The file is rewritten only when the listing changed (:func:`asrflow.data.prepare.listing.write_listing`).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from asrflow.data.prepare.listing import write_listing
from asrflow.errors import AsrflowError, exit_on_user_error
from asrflow.logs import setup_logging
from asrflow.params import load_params, require_mapping

#: Named after this module's import path (``__name__`` is ``__main__`` under ``python -m``).
logger = logging.getLogger("stages.corpus_listing")


def corpus_dirs(params: dict) -> list[str]:
    """The folders the ``prepare:`` section reads audio from: its ``corpus_dir``, or each of
    ``prepare.corpora``'s (an entry without one takes the section's), each once."""
    section = require_mapping(params.get("prepare"), "prepare")
    corpora = section.get("corpora") or [{}]
    if not isinstance(corpora, list):
        raise AsrflowError(f"params.yaml: prepare.corpora = {corpora!r} must be a list of corpora, or null")
    folders = []
    for number, entry in enumerate(corpora):
        folder = require_mapping(entry, f"prepare.corpora[{number}]").get("corpus_dir", section.get("corpus_dir"))
        if folder is None:
            raise AsrflowError("params.yaml: prepare.corpus_dir is not set; name the folder that holds the corpus")
        folders.append(str(folder))
    return list(dict.fromkeys(folders))


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml", help="params file (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("data/corpus_listing.tsv"), help="(default: %(default)s)")
    args = parser.parse_args(argv)
    setup_logging()
    folders = corpus_dirs(load_params(args.params))
    changed = write_listing(folders, args.out)
    logger.info("%s %s (%s)", "wrote" if changed else "unchanged:", args.out, ", ".join(folders))


if __name__ == "__main__":
    main()
