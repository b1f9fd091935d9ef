"""Every figure told once: measured figures live in bench/RESULTS.md, and the README, the docs and params.yaml's
comments link to its entries by their stable anchors (``bench/RESULTS.md#yesno-seeds``). The one figure the
README states itself, the test WER and CER of ``make run``, is what the committed ``exp/eval/metrics.json`` holds
(``dvc repro`` re-records it, so it is read, not written here)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "RESULTS.md"

#: The README's sentence that quotes the committed run, e.g. "test WER 1.25 %, CER 1.11 % (`exp/eval/metrics.json`,
#: committed with `dvc.lock`".
COMMITTED_RUN = re.compile(
    r"test WER (?P<wer>\d+(?:\.\d+)?) %, CER (?P<cer>\d+(?:\.\d+)?) % "
    r"\(`exp/eval/metrics\.json`, committed with `dvc\.lock`"
)
#: A WER or CER figure: the word, then within the same sentence a number and a per cent sign.
RATE_FIGURE = re.compile(r"\b(?P<kind>WER|CER)\b(?:[^.%]|\.(?=\d))*?(?P<value>\d+(?:\.\d+)?) ?%")
#: What a measurement looks like in prose, beside WER and CER: a speed, a ratio with a fraction ("1.56x"), a
#: real-time factor, or a number with a fraction and a unit of time, memory or share ("57.4 s", "0.71 %",
#: "1.5-3 hours"). Settings are whole numbers ("120 s batches", "256 MB"), so they do not match.
MEASURED = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:audio[- ]s/s|audio seconds per second|utterances/s|utts/s|segments/s"
    r"|[TGM]FLOP/s|steps/s)"
    r"|(?<![\w.])\d+\.\d+\s?(?:x|×)(?![\w])"
    r"|\b(?:RTF|real-time factor)\s+(?:of\s+)?\d"
    r"|(?<![\w.])\d+\.\d+(?:\s?-\s?\d+(?:\.\d+)?)?\s?(?:%|ms|s|min|minutes|h|hours|kB|MB|GB|GiB)(?![\w/])"
)
#: Figures that match :data:`MEASURED` but are not measurements, each with why it may stand outside RESULTS.
NOT_MEASURED = {
    ("docs/librispeech.md", "0.4 GB"): "mini LibriSpeech's download size, published with the corpus",
    ("docs/librispeech.md", "7.5 GB"): "LibriSpeech's download size, published with the corpus",
    ("docs/librispeech.md", "3.3 GB"): "arithmetic: 112 hours of fbank at one byte a value",
    ("docs/mlflow.md", "0.1 s"): "a setting: the shortest audio `transcribe` accepts",
    ("docs/decoding.md", "0.1 s"): "a setting: the shortest audio `transcribe` accepts",
}
#: A link or reference into bench/RESULTS.md with an anchor, in Markdown or in a comment.
RESULTS_ANCHOR = re.compile(r"RESULTS\.md#(?P<anchor>[\w\-]+)")
#: A reference into bench/RESULTS.md that names a section by its title instead of its anchor:
#: 'bench/RESULTS.md, "GPU, third run"', '[bench/RESULTS.md, "GPU"](...)', 'bench/RESULTS.md ("GPU")'.
TITLE_CITATION = re.compile(r"RESULTS\.md\]?\)?,?\s*\(?\"")
#: Files another change holds right now, which still cite RESULTS by a title; each must cite an anchor once it
#: lands (see the commit that added this list), and then leaves it.


def flat(text: str) -> str:
    """``text`` with every run of whitespace as one space, so a sentence may wrap anywhere."""
    return re.sub(r"\s+", " ", text)


def prose(text: str) -> str:
    """Markdown ``text`` without fenced code blocks and inline code: commands and settings, not prose."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    return re.sub(r"`[^`]*`", " ", text)


def yaml_comments(text: str) -> str:
    """The comments of a YAML file, one line each: what a reader is told, not the values."""
    return "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)


def percent(fraction: float) -> str:
    """A rate as the README writes it: per cent with two decimals (0.0125 -> "1.25")."""
    return f"{100 * fraction:.2f}"


def committed_metrics() -> dict[str, str]:
    """The committed run's pooled test WER and CER, as the README must quote them."""
    metrics = json.loads((REPO / "exp" / "eval" / "metrics.json").read_text())
    return {"WER": percent(metrics["wer"]), "CER": percent(metrics["cer"])}


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def results_anchors(text: str | None = None) -> set[str]:
    """Every anchor of bench/RESULTS.md: the explicit ``<a id="...">`` ones that code and docs cite, and each
    heading's (a repeated heading gets -1, -2, ... as on GitHub)."""
    text = RESULTS.read_text() if text is None else text
    anchors = set(re.findall(r'<a id="([\w\-]+)"></a>', text))
    seen: dict[str, int] = {}
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"#{1,6} (.+)", line)
        if heading:
            anchor = github_anchor(heading.group(1))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            anchors.add(anchor if count == 0 else f"{anchor}-{count}")
    return anchors


def pages() -> dict[str, str]:
    """What the figures rule covers, by path: the README, every doc and params.yaml's comments."""
    texts = {"README.md": (REPO / "README.md").read_text()}
    texts |= {f"docs/{page.name}": page.read_text() for page in sorted((REPO / "docs").glob("*.md"))}
    texts["params.yaml"] = yaml_comments((REPO / "params.yaml").read_text())
    return texts


def measured_figures(path: str, text: str) -> list[str]:
    """The measured figures ``text`` (of ``path``) states in its prose that RESULTS should hold instead: the
    README's quote of the committed run aside (checked against exp/eval/metrics.json above)."""
    text = flat(text)
    if path == "README.md":
        quoted = COMMITTED_RUN.search(text)
        assert quoted, "the README lost its sentence quoting the committed run"
        text = text[: quoted.start()] + text[quoted.end() :]
    text = flat(prose(text))
    rates = list(RATE_FIGURE.finditer(text))
    found = [f"{figure['kind']} {figure['value']} %" for figure in rates]
    found += [
        figure.group(0)
        for figure in MEASURED.finditer(text)
        if not any(rate.start() <= figure.start() < rate.end() for rate in rates)
    ]
    return [figure for figure in found if (path, figure) not in NOT_MEASURED]


def cited_files() -> list[Path]:
    """The tracked files that may cite RESULTS: code, docs, params and workflow files (RESULTS itself aside)."""
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    kinds = (".py", ".md", ".yaml", ".yml", ".smk", ".sh", ".toml", ".cfg")
    names = ("Makefile", "Snakefile")
    ours = {"bench/RESULTS.md", "tests/test_readme_figures.py"}
    return [
        REPO / name
        for name in listed.splitlines()
        if (name.endswith(kinds) or Path(name).name in names) and name not in ours and (REPO / name).is_file()
    ]


def test_readme_quotes_the_committed_make_run_metrics():
    readme = flat((REPO / "README.md").read_text())
    quoted = COMMITTED_RUN.search(readme)
    assert quoted, (
        "the README's Quick start should say 'test WER X %, CER Y % (`exp/eval/metrics.json`, committed with "
        "`dvc.lock`' for the committed run of `make run`"
    )
    committed = committed_metrics()
    assert (quoted["wer"], quoted["cer"]) == (committed["WER"], committed["CER"]), (
        f"the README quotes test WER {quoted['wer']} %, CER {quoted['cer']} %, but the committed "
        f"exp/eval/metrics.json holds WER {committed['WER']} %, CER {committed['CER']} %: after `dvc repro`, "
        "update the README's Quick start with the new figures"
    )


def test_no_measured_figure_outside_results():
    """The README (but for the committed run), the docs and params.yaml's comments link to RESULTS' entries."""
    stated = {path: found for path, text in pages().items() if (found := measured_figures(path, text))}
    assert not stated, (
        f"measured figures outside bench/RESULTS.md: {stated}; move each into its RESULTS entry (with its "
        "command, commit and machine) and link to it (bench/RESULTS.md#anchor), or, if it is a setting or a "
        "published size, list it in NOT_MEASURED with why"
    )


def test_results_links_name_an_anchor_there():
    """Every reference into RESULTS, in docs and in code comments, names an anchor RESULTS has, never a title."""
    anchors = results_anchors()
    broken, titled = [], []
    for path in cited_files():
        text = path.read_text(errors="replace")
        name = str(path.relative_to(REPO))
        links = RESULTS_ANCHOR.finditer(text)
        broken += [f"{name}: #{link['anchor']}" for link in links if link["anchor"] not in anchors]
        titled += [f"{name}:{text[: m.start()].count(chr(10)) + 1}" for m in TITLE_CITATION.finditer(text)]
    assert not broken, f"references to bench/RESULTS.md name no anchor there: {broken}"
    assert not titled, f"cite bench/RESULTS.md by its anchor (bench/RESULTS.md#name), not a section title: {titled}"


def test_results_is_a_reference():
    """RESULTS reads as a reference: at most 1,000 lines, a contents list, no diary of rounds."""
    text = RESULTS.read_text()
    assert len(text.splitlines()) <= 1000, f"bench/RESULTS.md has {len(text.splitlines())} lines, over 1,000"
    assert "## Contents" in text
    diary = [phrase for phrase in ("this round", "last round", "read this first") if phrase in text.lower()]
    assert not diary, f"bench/RESULTS.md reads as a diary: {diary}"
    contents = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    missing = sorted(set(re.findall(r"\]\(#([\w\-]+)\)", contents)) - results_anchors(text))
    assert not missing, f"the contents list links to anchors RESULTS lacks: {missing}"


def test_the_checks_catch_what_they_are_for():
    """A stale WER, a measured time or ratio, a title citation and a missing anchor are each caught; settings,
    versions and the README's committed figures are not."""
    stale = flat("ends with the test WER. The committed run reached a test WER of\n0.42 % (one error).")
    assert [figure["value"] for figure in RATE_FIGURE.finditer(stale)] == ["0.42"]
    assert [f["value"] for f in RATE_FIGURE.finditer("test WER 1.25 %, CER 1.11 %")] == ["1.25", "1.11"]
    measured = "The pipeline took 57.4 s; asrflow ran 1.60x SpeechBrain at 194.9 audio-s/s, about 1.5-3 hours."
    assert measured_figures("docs/x.md", measured) == ["57.4 s", "1.60x", "194.9 audio-s/s", "1.5-3 hours"]
    settings = "torch 2.14.1 on CUDA 13.0, 120 s batches, 256 MB floor, 12 x 256, 8 x 144, lr 0.001, 5 % goal."
    assert measured_figures("docs/x.md", settings) == []
    readme = "The committed run: test WER 0.42 %, CER 0.37 % (`exp/eval/metrics.json`, committed with `dvc.lock`"
    assert measured_figures("README.md", readme) == []
    assert measured_figures("README.md", readme + ". Elsewhere WER 1.25 %.") == ["WER 1.25 %"]
    assert measured_figures("params.yaml", yaml_comments("lr: 0.003  # measured 1.25% test WER"))
    for cited in ('(bench/RESULTS.md, "GPU, third run")', '[bench/RESULTS.md, "GPU"](x)', 'RESULTS.md ("GPU")'):
        assert TITLE_CITATION.search(cited), cited
    assert not TITLE_CITATION.search("(bench/RESULTS.md#gpu-first-pass)")
    page = '<a id="yesno-seeds"></a>\n### yesno over seeds\n```\n# not a heading\n```\n## Contents\n'
    assert results_anchors(page) == {"yesno-seeds", "yesno-over-seeds", "contents"}
    heading = "GPU (`python -m bench.gpu_checks`, shared/GPU_CHECKS.md; NVIDIA H100 80GB HBM3)"
    assert github_anchor(heading) == "gpu-python--m-benchgpu_checks-sharedgpu_checksmd-nvidia-h100-80gb-hbm3"
