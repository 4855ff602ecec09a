"""Python source from anywhere (a model's answer, a user's task file): parse it, or say it is not Python.

    tree = parse_python(text)          # ast.Module, or None

`ast.parse` refuses text in more ways than SyntaxError: null bytes (ValueError before Python
3.12), nesting deeper than the parser's stack (`-` * 3000 + `1`: RecursionError), text too big
to build a tree of (MemoryError). An answer or an imported task may be any of them, and each
is "not Python" to its caller, never a crash of the import, the audit or the scoring.
"""

from __future__ import annotations

import ast

PARSE_ERRORS = (SyntaxError, ValueError, RecursionError, MemoryError)


def parse_python(source: str | bytes) -> ast.Module | None:
    """The module `source` parses to, or None when it does not parse (any of PARSE_ERRORS)."""
    try:
        return ast.parse(source)
    except PARSE_ERRORS:
        return None
