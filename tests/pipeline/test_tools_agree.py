"""Snakemake and DVC run the same pipeline: same stages, commands, deps, params and outputs,
and, as the pipeline is deterministic, the same content in those outputs.

dvc.yaml states each stage once and workflow/rules/common.smk builds the Snakemake rules
from it; these tests hold the two tools to that, from what each tool itself reports.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
from pathlib import Path

import pytest
import torch
import yaml

from asrflow.data.prepare.listing import corpus_listing
from tests.support.pipeline_tools import (
    EXPECTED_OUTPUTS,
    LISTING,
    LISTING_FILE,
    STAGES,
    dvc_stages,
    run,
    snakemake_dry_run_rules,
    snakemake_rule_params,
    snakemake_rules_view,
)

pytestmark = pytest.mark.pipeline

# Files a tool writes for its own bookkeeping, not the pipeline's products.
BOOKKEEPING = re.compile(r"(^|/)(\.snakemake_timestamp|\.gitignore)$")
MAX_DEFAULT_WER = 0.02


def products(files: set[str]) -> set[str]:
    return {path for path in files if not BOOKKEEPING.search(path)}


def test_both_tools_write_the_same_files(snakemake_run, dvc_run):
    by_snakemake, by_dvc = products(snakemake_run.files), products(dvc_run.files)
    expected = set(EXPECTED_OUTPUTS)
    expected |= {
        f"data/manifests/{split}_{kind}.jsonl.gz"
        for split in ("train", "dev", "test")
        for kind in ("recordings", "supervisions", "cuts")
    }
    expected |= {"data/lang/tokenizer.model", "data/lang/tokens.txt"}
    assert expected <= by_snakemake, f"Snakemake did not write {sorted(expected - by_snakemake)}"
    assert expected <= by_dvc, f"DVC did not write {sorted(expected - by_dvc)}"
    assert by_snakemake == by_dvc, (
        f"only Snakemake wrote {sorted(by_snakemake - by_dvc)}; only DVC wrote {sorted(by_dvc - by_snakemake)}"
    )


def content(copy: Path, path: str):
    """What two runs of the deterministic pipeline must reproduce of ``path`` in ``copy``.

    The bytes, except: a gzip file's decompressed bytes (its header holds a time); the model
    bundle's payload without ``run_id`` (each tool's MLflow run has its own id);
    metrics.json without the ``rtf_*`` timings; and nothing of a checkpoint, which holds
    the run id and the optimizer's state (the bundle stands for its weights).
    """
    file = copy / path
    if path.startswith("exp/checkpoints/"):
        return None
    if path == "exp/model.pt":
        payload = torch.load(file, map_location="cpu", weights_only=True)
        payload.pop("run_id")
        return payload
    if path == "exp/eval/metrics.json":
        return {key: value for key, value in json.loads(file.read_text()).items() if not key.startswith("rtf_")}
    if path.endswith(".gz"):
        return gzip.decompress(file.read_bytes())
    return file.read_bytes()


def same(a, b) -> bool:
    """Equality that also holds tensors (same dtype, shape and values) inside dicts and lists."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def test_both_tools_write_the_same_content(snakemake_run, dvc_run):
    """Manifests, features, tokenizer, model weights, reports and metrics (timings aside) are equal."""
    common = sorted(products(snakemake_run.files) & products(dvc_run.files))
    assert "exp/model.pt" in common and "data/lang/tokens.txt" in common
    differ = [path for path in common if not same(content(snakemake_run.copy, path), content(dvc_run.copy, path))]
    assert not differ, f"Snakemake and DVC wrote different {differ}"
    assert snakemake_run.metrics["wer"] == dvc_run.metrics["wer"]
    assert snakemake_run.metrics["cer"] == dvc_run.metrics["cer"]


@pytest.mark.parametrize("tool", ["snakemake", "dvc"])
def test_default_params_reach_the_target_wer(tool, request):
    result = request.getfixturevalue(f"{tool}_run")
    metrics = result.metrics
    assert metrics["num_utterances"] == 30 and metrics["num_missing_hyps"] == 0, metrics
    assert metrics["wer"] <= MAX_DEFAULT_WER, (
        f"{tool}: test WER {metrics['wer']:.4f} > {MAX_DEFAULT_WER} with the default params "
        f"({metrics['word_errors']} errors in {metrics['ref_words']} words)"
    )


def test_snakemake_lint_has_no_findings(snakemake_run):
    result = run(snakemake_run.copy, "snakemake", "--lint", timeout=180)
    assert "Lints for" not in result.stdout, result.stdout
    assert "Congratulations, your workflow is in a good condition!" in result.stdout, result.stdout


def _without_log_redirect(shell: str, stage: str) -> str:
    """The dvc.yaml command inside a rule's shell: without the environment that tells the
    stage where its log and the terminal are, and without the redirects to them."""
    log = rf"(\{{log\}}|logs/{stage}\.log)"
    prefix = re.compile(
        rf"^ASRFLOW_PIPELINE=snakemake ASRFLOW_STAGE={stage} ASRFLOW_LOG_FILE={log} ASRFLOW_PROGRESS_FD=3 "
        r"ASRFLOW_THREADS=\d+\s+"
    )
    suffix = re.compile(rf"\s+3>&2\s*>\s*{log}\s+2>&1\s*$")
    assert suffix.search(shell), f"rule {stage} does not send its output to its log: {shell!r}"
    assert prefix.search(shell), f"rule {stage} does not tell the stage where its log is: {shell!r}"
    return suffix.sub("", prefix.sub("", shell))


def _value(params: dict, dotted_key: str):
    node = params
    for part in dotted_key.split("."):
        node = node[part]
    return node


def test_snakemake_rules_are_the_dvc_stages(snakemake_run):
    """Per stage: the same command (minus the log redirect), deps, non-persisted outs and params.

    DVC's always-changed listing stage is no rule: Snakemake runs its command while reading the
    workflow, and the rule that depends on its output has the output's SHA-256 as a param instead.
    """
    copy = snakemake_run.copy
    stages = dvc_stages(copy)
    rules = snakemake_dry_run_rules(copy)
    rule_params = snakemake_rule_params(copy)
    params_yaml = yaml.safe_load((copy / "params.yaml").read_text())

    assert list(stages) == [LISTING, *STAGES]
    assert [name for name, stage in stages.items() if stage["always_changed"]] == [LISTING]
    assert list(stages[LISTING]["outs"]) == [LISTING_FILE]
    assert set(rules) == set(STAGES) | {"all"}, f"Snakemake's rules: {sorted(rules)}"
    assert set(rule_params) == set(rules)
    produced = {out for stage in stages.values() for out in stage["outs"]}
    corpus_dir = params_yaml["prepare"]["corpus_dir"]
    listing = "".join(f"{line}\n" for line in [f"# {corpus_dir}", *corpus_listing(copy / corpus_dir)])
    assert (copy / LISTING_FILE).read_text() == listing, "Snakemake did not write the corpus listing"
    digest = {re.sub(r"\W", "_", LISTING_FILE): hashlib.sha256(listing.encode()).hexdigest()}

    for name, stage in stages.items():
        if name == LISTING:
            continue
        rule = rules[name]
        assert rule["log"] == [f"logs/{name}.log"], f"rule {name}'s log: {rule['log']}"
        assert _without_log_redirect(rule["shell"], name) == stage["cmd"], f"rule {name}'s shell: {rule['shell']!r}"

        expected_inputs = set()
        for dep in stage["deps"]:
            path = copy / dep
            if dep == LISTING_FILE:
                continue  # a param
            if dep in produced or not path.is_dir():
                expected_inputs.add(dep)
            else:  # code or corpus folder: Snakemake lists its files, so that editing one re-runs the rule
                expected_inputs |= {
                    file.relative_to(copy).as_posix()
                    for file in path.rglob("*")
                    if file.is_file() and "__pycache__" not in file.parts
                }
        assert set(rule["input"]) == expected_inputs, (
            f"rule {name}: inputs DVC lacks {sorted(set(rule['input']) - expected_inputs)}, "
            f"deps Snakemake lacks {sorted(expected_inputs - set(rule['input']))}"
        )

        kept = {out for out, options in stage["outs"].items() if not options["persist"]}
        persisted = set(stage["outs"]) - kept
        assert set(rule["output"]) == kept, f"rule {name}'s outputs {rule['output']} != dvc outs {sorted(kept)}"
        assert not persisted & set(rule["output"]), f"Snakemake would delete persisted outs {sorted(persisted)}"

        keys = [key for keys in stage["params"].values() for key in keys]
        assert list(stage["params"]) == ["params.yaml"], f"stage {name} reads params from {list(stage['params'])}"
        expected_params = {re.sub(r"\W", "_", key): _value(params_yaml, key) for key in keys}
        if LISTING_FILE in stage["deps"]:
            expected_params |= digest
        assert rule_params[name] == expected_params, f"rule {name}'s params differ from dvc.yaml's {keys}"


def test_snakemake_rules_declare_the_cores_their_stage_keeps_busy(snakemake_run):
    """Features and the tokenizer both follow prepare: with each rule's threads declared, ``--cores N``
    runs side by side only what fits, and each stage learns its grant (at most N) as $ASRFLOW_THREADS."""
    copy = snakemake_run.copy
    num_jobs = yaml.safe_load((copy / "params.yaml").read_text())["features"]["num_jobs"]
    cores = os.cpu_count()
    threads = {name: rule["threads"] for name, rule in snakemake_rules_view(copy).items() if name in STAGES}
    assert threads == {"prepare": 1, "features": num_jobs or cores, "tokenizer": 1, "train": cores, "evaluate": cores}
    for name, rule in snakemake_dry_run_rules(copy).items():  # --cores 1: every grant is 1
        if name in STAGES:
            assert "ASRFLOW_THREADS=1 " in rule["shell"], f"rule {name}: {rule['shell']!r}"


def test_the_corpus_listing_runs_once_per_invocation(snakemake_run):
    """The main process runs the listing when it builds the jobs; --lint builds none, and a job's own
    reading of the workflow (a Slurm job's, mode REMOTE) takes the listing the main process wrote."""
    copy = snakemake_run.copy
    listing = copy / LISTING_FILE
    written = listing.read_bytes()
    param = re.sub(r"\W", "_", LISTING_FILE)
    try:
        listing.unlink()
        run(copy, "snakemake", "--lint", timeout=180)
        assert not listing.exists(), "snakemake --lint ran the corpus listing"

        stale = written + b"# not what the corpus holds now\n"
        listing.write_bytes(stale)
        in_a_job = snakemake_rule_params(copy, mode="REMOTE")["prepare"][param]
        assert listing.read_bytes() == stale, "a job's reading of the workflow ran the corpus listing again"
        assert in_a_job == hashlib.sha256(stale).hexdigest()

        in_the_main_process = snakemake_rule_params(copy)["prepare"][param]
        assert listing.read_bytes() == written, "the main process did not run the corpus listing"
        assert in_the_main_process == hashlib.sha256(written).hexdigest()
    finally:
        listing.write_bytes(written)
