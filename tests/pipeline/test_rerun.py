"""What each tool would re-run: nothing after a run, and after one edit exactly that stage and
those downstream of it, for a params key of each section and for the code a stage uses.

For DVC, ``dvc status`` must find exactly the stages that read the edited key or file changed,
for the edited key or file alone, and ``dvc repro --dry --force-downstream`` must add exactly
the stages downstream of them.

Only dry runs: each edit is undone (bytes and file times), so the copies stay up to date.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tests.support.pipeline_tools import (
    LISTING,
    LISTING_FILE,
    STAGES,
    appended_comment,
    dvc_dry_run,
    dvc_ran_stages,
    dvc_status,
    edited_params,
    restored,
    run,
    snakemake_dry_run,
)
from tests.support.repo import tool_env

pytestmark = pytest.mark.pipeline

ALL = set(STAGES)
FROM_FEATURES = {"features", "train", "evaluate"}
FROM_TOKENIZER = {"tokenizer", "train", "evaluate"}
FROM_TRAIN = {"train", "evaluate"}
EVALUATE = {"evaluate"}


def would_run(snakemake_run, dvc_run) -> dict[str, set[str]]:
    return {"snakemake": snakemake_dry_run(snakemake_run.copy), "dvc": dvc_dry_run(dvc_run.copy)}


def test_a_second_run_has_nothing_to_do(snakemake_run, dvc_run):
    """Only the corpus listing runs again (DVC: always; Snakemake: while reading the workflow)."""
    snakemake = run(snakemake_run.copy, "snakemake", "--dry-run", "--cores", "1", timeout=180).stdout
    assert "Nothing to be done" in snakemake, snakemake
    status = run(dvc_run.copy, "dvc", "status", timeout=180).stdout
    assert f"{LISTING}:" in status and "always changed" in status, status
    assert dvc_status(dvc_run.copy) == {}
    assert dvc_dry_run(dvc_run.copy) == set()


def test_a_no_op_run_runs_nothing_but_the_listing(snakemake_run, dvc_run):
    snakemake = run(snakemake_run.copy, "snakemake", "--cores", "all", timeout=180).stdout
    assert "Nothing to be done" in snakemake, snakemake
    dvc = run(dvc_run.copy, "dvc", "repro", timeout=180).stdout
    assert dvc_ran_stages(dvc) == {LISTING}, dvc
    assert "Stage 'prepare' didn't change, skipping" in dvc, dvc


@contextmanager
def corpus_edit(copy: Path, edit: str) -> Iterator[None]:
    """One audio file of the copy's corpus touched, replaced (same size, other bytes), added or
    removed; undone after, times included."""
    corpus = copy / yaml.safe_load((copy / "params.yaml").read_text())["prepare"]["corpus_dir"]
    audio = sorted(corpus.glob("*.wav"))[0]
    if edit == "added":
        extra = audio.with_name("extra.wav")
        shutil.copy2(audio, extra)
        try:
            yield
        finally:
            extra.unlink()
        return
    if edit == "removed":
        aside = copy / "removed.wav"
        audio.rename(aside)
        try:
            yield
        finally:
            aside.rename(audio)
        return
    with restored(audio):
        stat = audio.stat()
        if edit == "replaced":
            data = audio.read_bytes()
            audio.write_bytes(data[:-2] + bytes(b ^ 0xFF for b in data[-2:]))
        os.utime(audio, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))
        yield


@pytest.mark.parametrize("edit", ["touched", "replaced", "added", "removed"])
def test_a_corpus_change_reruns_prepare_and_downstream(snakemake_run, dvc_run, *, edit):
    """prepare depends on the corpus listing (path, size, modification time of every file),
    not on the corpus folder: any file touched, replaced, added or removed re-runs it; undone,
    nothing. (The listing is a param of Snakemake's prepare rule, a dep of DVC's stage.)"""
    with corpus_edit(snakemake_run.copy, edit), corpus_edit(dvc_run.copy, edit):
        seen = would_run(snakemake_run, dvc_run)
        changed = dvc_status(dvc_run.copy)
    assert seen == {"snakemake": ALL, "dvc": ALL}, f"after a corpus file was {edit}"
    assert changed == {"prepare": {LISTING_FILE}}, f"dvc status after a corpus file was {edit}"
    assert would_run(snakemake_run, dvc_run) == {"snakemake": set(), "dvc": set()}, f"{edit}, then undone"


# Values no default is likely to have: each must differ from params.yaml's. ``readers``: the
# stages that declare the key's section (they change themselves); ``expected``: those and
# every stage downstream of them.
@pytest.mark.parametrize(
    ("key", "value", "readers", "expected"),
    [
        ("seed", 1234, {"prepare", "train"}, ALL),
        ("prepare.dev_fraction", 0.15, {"prepare"}, ALL),
        ("features.num_mel_bins", 72, {"features", "train"}, FROM_FEATURES),
        ("tokenizer.character_coverage", 0.9995, {"tokenizer"}, FROM_TOKENIZER),
        ("train.optim.lr", 0.00123, {"train"}, FROM_TRAIN),
        ("train.model.num_layers", 3, {"train"}, FROM_TRAIN),
        # bookkeeping and where the run executes: a finished model stays
        ("train.checkpoint.checkpoint_every_steps", 77, set(), set()),
        ("run.experiment", "elsewhere", set(), set()),
        ("run.num_workers", 1, set(), set()),
        ("evaluate.beam_size", 5, {"evaluate"}, EVALUATE),
    ],
)
def test_a_params_change_reruns_its_stage_and_downstream(snakemake_run, dvc_run, *, key, value, readers, expected):
    with edited_params(snakemake_run.copy, key, value), edited_params(dvc_run.copy, key, value):
        seen = would_run(snakemake_run, dvc_run)
        changed = dvc_status(dvc_run.copy)
    assert seen == {"snakemake": expected, "dvc": expected}, f"after changing {key}"
    section = ".".join(key.split(".")[:2]) if key.startswith("train.") else key.split(".")[0]  # as dvc.yaml lists it
    assert changed == {stage: {f"params.yaml:{section}"} for stage in readers}, f"dvc status after changing {key}"


# ``dep``: how dvc.yaml lists the edited file (itself, or a folder holding it); ``readers``:
# the stages that list it.
@pytest.mark.parametrize(
    ("path", "dep", "readers", "expected"),
    [
        ("stages/prepare.py", "stages/prepare.py", {"prepare"}, ALL),
        ("asrflow/data/prepare/text.py", "asrflow/data/prepare/text.py", {"prepare"}, ALL),
        (
            "asrflow/data/features/config.py",
            "asrflow/data/features/config.py",
            {"features", "train", "evaluate"},
            FROM_FEATURES,
        ),
        ("stages/tokenizer.py", "stages/tokenizer.py", {"tokenizer"}, FROM_TOKENIZER),
        ("asrflow/training/step.py", "asrflow/training/step.py", {"train"}, FROM_TRAIN),
        # train logs the model as an MLflow pyfunc that decodes with this code: it reads the folder too.
        ("asrflow/decoding/ctc.py", "asrflow/decoding", {"train", "evaluate"}, FROM_TRAIN),  # one file of a folder dep
        ("asrflow/training/tune.py", None, set(), set()),  # the tuner: beside training's code, never imported by it
    ],
)
def test_a_code_change_reruns_its_stage_and_downstream(snakemake_run, dvc_run, *, path, dep, readers, expected):
    with appended_comment(snakemake_run.copy / path), appended_comment(dvc_run.copy / path):
        seen = would_run(snakemake_run, dvc_run)
        changed = dvc_status(dvc_run.copy)
    assert seen == {"snakemake": expected, "dvc": expected}, f"after editing {path}"
    assert changed == {stage: {dep} for stage in readers}, f"dvc status after editing {path}"


def test_bytecode_caches_are_not_code_changes(snakemake_run, dvc_run):
    """Python writes __pycache__/ next to the code it imports (tests, a newer Python): no re-run."""
    copies = (snakemake_run.copy, dvc_run.copy)
    try:
        for copy in copies:
            env = tool_env(copy)
            env.pop("PYTHONDONTWRITEBYTECODE")
            run(copy, "python", "-m", "compileall", "-q", "asrflow", "stages", env=env, timeout=300)
        seen = would_run(snakemake_run, dvc_run)
    finally:
        for copy in copies:
            for cache in [*copy.glob("asrflow/**/__pycache__"), *copy.glob("stages/__pycache__")]:
                shutil.rmtree(cache, ignore_errors=True)
    assert seen == {"snakemake": set(), "dvc": set()}


@pytest.mark.parametrize(("path", "expected"), [("exp/model.pt", FROM_TRAIN), ("data/lang", FROM_TOKENIZER)])
def test_a_missing_output_reruns_its_stage_and_downstream(snakemake_run, dvc_run, *, path, expected):
    """A stage that failed or was stopped leaves its output missing (Snakemake removes it before
    the job; DVC too): the next run must make it again, although everything downstream is
    present and up to date."""
    copies = (snakemake_run.copy, dvc_run.copy)
    try:
        for copy in copies:
            (copy / path).rename(copy / f"{path}.aside")
        seen = would_run(snakemake_run, dvc_run)
    finally:
        for copy in copies:
            (copy / f"{path}.aside").rename(copy / path)
    assert seen == {"snakemake": expected, "dvc": expected}, f"with {path} missing"
