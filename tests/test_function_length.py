"""Every function in ``asrflow/`` fits on a screen: at most :data:`MAX_LINES` lines, counted from
its first decorator (or its ``def``) to its last line, docstring and comments included.

Exempt: functions that build an argparse parser, whose length is one ``add_argument`` per
option. A function builds one when its name starts with ``build_parser``, or when it calls
``argparse.ArgumentParser`` (or ``ArgumentParser``) and returns that parser by name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from tests.support.repo import REPO

PACKAGE = REPO / "asrflow"
MAX_LINES = 60

Function = ast.FunctionDef | ast.AsyncFunctionDef


def _functions(tree: ast.AST) -> Iterator[Function]:
    """Every function of ``tree``: top level, methods and nested ones."""
    for node in ast.walk(tree):
        if isinstance(node, Function):
            yield node


def _length(function: Function) -> int:
    """Lines from the first decorator (or the ``def``) through the function's last line."""
    first = min([function.lineno, *(decorator.lineno for decorator in function.decorator_list)])
    return function.end_lineno - first + 1


def _is_parser_call(node: ast.AST) -> bool:
    """``argparse.ArgumentParser(...)`` or ``ArgumentParser(...)``."""
    if not isinstance(node, ast.Call):
        return False
    called = node.func
    if isinstance(called, ast.Attribute):
        return called.attr == "ArgumentParser" and isinstance(called.value, ast.Name) and called.value.id == "argparse"
    return isinstance(called, ast.Name) and called.id == "ArgumentParser"


def _builds_parser(function: Function) -> bool:
    """Named ``build_parser*``, or assigns ``ArgumentParser(...)`` to a name that it returns."""
    if function.name.startswith("build_parser"):
        return True
    parsers = {
        target.id
        for node in ast.walk(function)
        if isinstance(node, ast.Assign) and _is_parser_call(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    return any(
        isinstance(node, ast.Return) and isinstance(node.value, ast.Name) and node.value.id in parsers
        for node in ast.walk(function)
    )


def test_functions_are_at_most_60_lines():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for function in _functions(tree):
            if _length(function) > MAX_LINES and not _builds_parser(function):
                too_long.append(f"{path.relative_to(REPO)}:{function.lineno} {function.name} ({_length(function)})")
    assert not too_long, f"functions over {MAX_LINES} lines (split them): {too_long}"


def test_the_rule_exempts_parser_builders_only():
    source = """
import argparse

def make_parser():
    parser = argparse.ArgumentParser()
    return parser

def parse_args(argv):
    parser = argparse.ArgumentParser()
    return parser.parse_args(argv)

def build_parser_for_serving():
    ...
"""
    exempt = {function.name: _builds_parser(function) for function in _functions(ast.parse(source))}
    assert exempt == {"make_parser": True, "parse_args": False, "build_parser_for_serving": True}


def test_length_counts_decorators_and_docstring():
    source = '''
@staticmethod
@other
def f():
    """Doc."""
    return 1
'''
    (function,) = _functions(ast.parse(source))
    assert _length(function) == 5
