"""Every params key the docs and the workflow profiles name exists: a renamed or moved key (``train.num_workers``
became ``run.num_workers``) must not live on in the instructions users follow. params.yaml holds every key of
every section (tests/test_params.py: the config dataclasses have no defaults of their own), so its flattened keys
and their sections are the whole vocabulary."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from asrflow.params import flatten

REPO = Path(__file__).resolve().parents[1]

#: A dotted params key: a top-level section, then one or more names (``train.optim.lr``, ``run.num_workers``).
#: Not part of a path or a longer name (``stages/train.py``, ``asrflow.training.run``), not a call
#: (``run.stop.request()``).
DOTTED_KEY = re.compile(
    r"(?<![\w/.\-])(?P<key>(?:prepare|features|tokenizer|train|run|evaluate)(?:\.[A-Za-z_]\w*)+)(?![\w(]|\.[A-Za-z_])"
)
#: A name ending in these is a file (``train.py``, ``run.yaml``), not a key.
FILE_SUFFIXES = {"py", "md", "yaml", "yml", "json", "jsonl", "pt", "db", "smk", "sh", "txt", "log", "csv", "png"}
#: Mappings whose keys are the user's own names (a corpus's weight, a recipe's arguments, a split's name).
FREE_MAPPINGS = ("train.data.corpus_weights.", "prepare.recipe_args.", "prepare.splits.")
#: Keys named on purpose although they do not exist, each with why.
NOT_KEYS = {
    ("docs/params.md", "train.lr"): "the example of a misplaced key that the error message corrects",
}


def known_keys() -> set[str]:
    """params.yaml's dotted keys and every section above them (``train.optim`` as well as ``train.optim.lr``)."""
    keys = set(flatten(yaml.safe_load((REPO / "params.yaml").read_text())))
    return keys | {key.rsplit(".", depth)[0] for key in keys for depth in range(1, key.count(".") + 1)}


def named_keys(text: str) -> list[str]:
    """The dotted params keys ``text`` names, in order (file names left out)."""
    return [m["key"] for m in DOTTED_KEY.finditer(text) if m["key"].rsplit(".", 1)[1] not in FILE_SUFFIXES]


def unknown_keys(path: str, text: str, known: set[str]) -> list[str]:
    """The keys ``text`` (of ``path``) names that params.yaml lacks, as ``path:line: key``."""
    unknown = []
    for number, line in enumerate(text.splitlines(), 1):
        for key in named_keys(line):
            if key in known or key.startswith(FREE_MAPPINGS) or (path, key) in NOT_KEYS:
                continue
            unknown.append(f"{path}:{number}: {key}")
    return unknown


def pages() -> list[Path]:
    """The workflow profiles and the docs."""
    profiles = sorted(path for path in (REPO / "workflow" / "profiles").rglob("*") if path.is_file())
    return [*profiles, *sorted((REPO / "docs").glob("*.md"))]


def test_every_params_key_named_in_docs_and_profiles_exists():
    known = known_keys()
    unknown = [
        entry for page in pages() for entry in unknown_keys(str(page.relative_to(REPO)), page.read_text(), known)
    ]
    assert not unknown, f"params keys that params.yaml does not have (renamed or moved?): {unknown}"


def test_the_check_catches_a_stale_key():
    known = known_keys()
    stale = "cpus_per_task: 2  # train.num_workers data workers + train.num_threads per process"
    assert unknown_keys("workflow/profiles/x.yaml", stale, known) == [
        "workflow/profiles/x.yaml:1: train.num_workers",
        "workflow/profiles/x.yaml:1: train.num_threads",
    ]
    current = "`run.num_workers`, `train.optim.num_threads`, `train.optim`, `train.model.*`, `features.num_jobs: 0`"
    assert unknown_keys("docs/x.md", current, known) == []
    not_keys = "stages/train.py, asrflow/tracking/run.py, `run.stop.request()`, asrflow.training.run, run.yaml"
    assert named_keys(not_keys) == []
    assert unknown_keys("docs/x.md", "`train.data.corpus_weights.mine: 2`", known) == []
