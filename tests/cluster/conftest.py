"""The Slurm tests' line in the session summary: how many ran, and why any were skipped."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter):
    outcomes: dict[str, str] = {}
    reasons: set[str] = set()
    for outcome in ("passed", "failed", "error", "skipped"):
        for report in terminalreporter.stats.get(outcome, []):
            if "slurm" not in getattr(report, "keywords", {}) or report.nodeid in outcomes:
                continue
            outcomes[report.nodeid] = outcome
            if outcome == "skipped" and isinstance(report.longrepr, tuple):
                reasons.add(report.longrepr[2].removeprefix("Skipped: "))
    if not outcomes:
        return
    counts = {outcome: list(outcomes.values()).count(outcome) for outcome in ("passed", "failed", "error", "skipped")}
    ran = counts["passed"] + counts["failed"] + counts["error"]
    line = f"Slurm tests: {ran} ran ({counts['passed']} passed, {counts['failed'] + counts['error']} failed)"
    if counts["skipped"]:
        line += f", {counts['skipped']} skipped: {'; '.join(sorted(reasons))}"
    terminalreporter.write_line(line)
