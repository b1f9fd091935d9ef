"""Docs as tests, first level: every command the README tells a user to type names a program that is there.

Each line of the README's ```bash / ```sh blocks that is not a comment is a command line; ``&&`` and ``|`` split it
into commands, and for each: ``make`` targets exist in the Makefile; ``asrflow SUB`` is a subcommand whose
``--help`` exits 0 (``python -m asrflow.cli SUB --help``) and lists every ``--option`` the README gives it;
``python -m MODULE`` imports and its ``--help`` exits 0; ``dvc``/``mlflow`` subcommands' ``--help`` exits 0;
``pip install`` names a constraints file and extras that exist; the other tools are on PATH. A command that needs
what this machine lacks ends with ``# needs a GPU`` or ``# needs a cluster`` and is only checked for its program.
Not covered yet: the commands in docs/*.md, and whether each command does what the README says."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(?:bash|sh)\n(?P<body>.*?)^```", re.S | re.M)
NEEDS = re.compile(r"#\s*needs an? (?:GPU|cluster)\s*$")
#: Programs that are only checked to be on PATH (their subcommands are the user's own, like git's).
ON_PATH = {"snakemake", "dvc", "mlflow", "pip", "git", "python3", "python"}
#: Subcommands whose --help this test runs (each tool's start-up is slow; these are what the README names).
HELPED = {"dvc", "mlflow"}


def command_lines(text: str) -> list[str]:
    """The command lines of ``text``'s bash/sh blocks: not blank, not comments; a trailing comment kept."""
    return [
        line.strip()
        for block in FENCE.finditer(text)
        for line in block["body"].splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def split_line(line: str) -> tuple[list[list[str]], bool]:
    """A command line's commands (each a list of words, comment dropped) and whether it is marked as needing
    what this machine lacks."""
    needs = bool(NEEDS.search(line))
    lexer = shlex.shlex(line, posix=True, punctuation_chars="&|;")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands, words = [], []
    for token in lexer:
        if token in {"&&", "|", "||", ";"}:
            commands.append(words)
            words = []
        else:
            words.append(token)
    return [words for words in [*commands, words] if words], needs


@cache
def make_targets() -> set[str]:
    return set(re.findall(r"^([\w\-]+)\s*:(?!=)", (REPO / "Makefile").read_text(), flags=re.M))


@cache
def help_text(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*argv, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)


def extras() -> set[str]:
    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def leading_words(words: list[str], most: int) -> list[str]:
    """The first ``most`` words of a subcommand, up to the first option or argument-looking word."""
    out = []
    for word in words[:most]:
        if not re.fullmatch(r"[a-z]+", word):
            break
        out.append(word)
    return out


def problems(words: list[str], needs: bool) -> list[str]:
    """What is wrong with one command; empty when it checks out."""
    program, args = words[0], words[1:]
    if program in {".", "source"}:
        return [] if args and (REPO / args[0]).exists() else [f"{program} {' '.join(args)}: no such file"]
    if shutil.which(program) is None and program not in {"asrflow", "make"}:
        return [f"{program} is not on PATH"]
    if needs:
        return []
    if program == "make":
        return [f"make has no target {target!r}" for target in args if target not in make_targets()]
    if program == "asrflow":
        return asrflow_problems(args)
    if program in {"python", "python3"} and args[:1] == ["-m"]:
        module = args[1]
        if module == "venv":
            return []
        done = help_text(sys.executable, "-m", module)
        return [] if done.returncode == 0 else [f"python -m {module} --help exited {done.returncode}: {done.stderr}"]
    if program == "pip":
        return pip_problems(args)
    if program in HELPED:
        sub = leading_words(args, 2)
        done = help_text(program, *sub)
        return [] if done.returncode == 0 else [f"{program} {' '.join(sub)} --help exited {done.returncode}"]
    return []


def asrflow_problems(args: list[str]) -> list[str]:
    if not args or args[0].startswith("-"):
        done = help_text(sys.executable, "-m", "asrflow.cli")
        if done.returncode != 0:
            return [f"asrflow --help exited {done.returncode}"]
        return [f"asrflow has no option {arg}" for arg in args if arg.startswith("--") and arg not in done.stdout]
    done = help_text(sys.executable, "-m", "asrflow.cli", args[0])
    if done.returncode != 0:
        return [f"asrflow {args[0]} --help exited {done.returncode}: {done.stderr.strip()[-300:]}"]
    options = [arg.split("=", 1)[0] for arg in args[1:] if arg.startswith("--")]
    return [f"asrflow {args[0]} has no option {option}" for option in options if option not in done.stdout]


def pip_problems(args: list[str]) -> list[str]:
    found = []
    for flag, value in zip(args, args[1:], strict=False):
        if flag == "-c" and not (REPO / value).is_file():
            found.append(f"pip -c {value}: no such file")
    for arg in args:
        named = re.fullmatch(r"\.\[(?P<extras>[\w,\-]+)\]", arg)
        if named:
            found += [
                f"no extra {name!r} in pyproject.toml" for name in named["extras"].split(",") if name not in extras()
            ]
    return found


def readme_problems(text: str) -> list[str]:
    found = []
    for line in command_lines(text):
        commands, needs = split_line(line)
        found += [f"{line!r}: {problem}" for words in commands for problem in problems(words, needs)]
    return found


def test_every_readme_command_names_what_is_there():
    lines = command_lines((REPO / "README.md").read_text())
    assert len(lines) >= 10, f"the README's command blocks were not found: {lines}"
    assert not (found := readme_problems((REPO / "README.md").read_text())), "\n".join(found)


def test_the_readme_shows_quick_start_first_and_stays_short():
    text = (REPO / "README.md").read_text()
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    assert headings[:2] == ["Quick start", "Your own corpus"], headings
    assert len(text.splitlines()) <= 200
    first = command_lines(text[text.index("## Quick start") : text.index("## Your own corpus")])
    assert [line.split("#")[0].strip() for line in first] == ["make run", "make test"]


def test_every_front_door_subcommand_is_in_the_readmes_commands_table():
    text = (REPO / "README.md").read_text()
    for sub in ("corpus", "preset", "tune", "transcribe", "export"):
        assert f"| `asrflow {sub}" in text, sub
    for tool in ("snakemake", "dvc", "mlflow"):
        assert f"| `{tool} " in text, tool


@pytest.mark.parametrize(
    "line",
    [
        "asrflow bogus data/x",
        "asrflow transcribe --modle exp/model.pt a.wav",
        "make no-such-target",
        "python -m asrflow.no_such_module --help",
        "pip install -c constraints.txt -e '.[nosuchextra]'",
        "nosuchtool --cores all",
        "dvc nosuchcommand run",
    ],
)
def test_a_wrong_command_is_caught(line):
    assert readme_problems(f"```bash\n{line}\n```\n"), line


def test_a_marked_command_is_only_checked_for_its_program():
    assert not readme_problems("```bash\nsnakemake --executor nosuch --profile x   # needs a cluster\n```\n")
    assert readme_problems("```bash\nnosuchtool --x   # needs a GPU\n```\n")
