"""Every figure told once: measured figures live in bench/RESULTS.md and the README and docs link to
its entries; the one figure the README states itself, the test WER and CER of ``make run``, is what the
committed ``exp/eval/metrics.json`` holds (``dvc repro`` re-records it, so it is read, not written here)."""

from __future__ import annotations

import json
import re
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
#: A Markdown link into bench/RESULTS.md with an anchor.
RESULTS_LINK = re.compile(r"\]\((?P<path>[^)#\s]*RESULTS\.md)#(?P<anchor>[^)\s]+)\)")


def flat(text: str) -> str:
    """``text`` with every run of whitespace as one space, so a sentence may wrap anywhere."""
    return re.sub(r"\s+", " ", text)


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


def results_anchors() -> set[str]:
    """Every heading anchor of bench/RESULTS.md (a repeated heading gets -1, -2, ... as on GitHub)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in RESULTS.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"#{1,6} (.+)", line)
        if heading:
            anchor = github_anchor(heading.group(1))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            anchors.add(anchor if count == 0 else f"{anchor}-{count}")
    return anchors


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


def test_readme_states_no_other_wer_or_cer():
    readme = flat((REPO / "README.md").read_text())
    committed = committed_metrics()
    stale = [
        f"{figure['kind']} {figure['value']} %"
        for figure in RATE_FIGURE.finditer(readme)
        if figure["value"] != committed[figure["kind"]]
    ]
    assert not stale, (
        f"the README states {stale}, not the committed exp/eval/metrics.json's WER {committed['WER']} % / "
        f"CER {committed['CER']} %: link to the bench/RESULTS.md entry instead"
    )


def test_links_into_results_name_a_heading():
    anchors = results_anchors()
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = [
        f"{page.relative_to(REPO)}: #{link['anchor']}"
        for page in pages
        for link in RESULTS_LINK.finditer(page.read_text())
        if (page.parent / link["path"]).resolve() == RESULTS.resolve() and link["anchor"] not in anchors
    ]
    assert not broken, f"links to bench/RESULTS.md name no heading there: {broken}"


def test_the_checks_catch_what_they_are_for():
    """A stale WER is caught, and anchors follow GitHub's rule (checked on a heading the README links to)."""
    stale = flat("ends with the test WER. The committed run reached a test WER of\n0.42 % (one error).")
    assert [figure["value"] for figure in RATE_FIGURE.finditer(stale)] == ["0.42"]
    assert [f["value"] for f in RATE_FIGURE.finditer("test WER 1.25 %, CER 1.11 %")] == ["1.25", "1.11"]
    heading = "GPU (`python -m bench.gpu_checks`, shared/GPU_CHECKS.md; NVIDIA H100 80GB HBM3)"
    assert github_anchor(heading) == "gpu-python--m-benchgpu_checks-sharedgpu_checksmd-nvidia-h100-80gb-hbm3"
