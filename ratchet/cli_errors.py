"""How every `ratchet` command fails: one line on stderr, `error: <what> (<where>)`, never a
traceback. Exit 2 for bad input or usage, 1 for a check that ran and failed.

    from ratchet.cli_errors import fail, read_text, require_model_dir
    text = read_text(path, "tasks JSONL")       # missing, directory, binary, not UTF-8: fail(...)
    fail("no completion lines", path)           # prints, exits 2
    require_model_dir(path)                     # a model directory load_policy loads, or fail(...)

`OneLineErrors` is the root command group (ratchet/cli.py): typer's usage errors (a wrong
type, a missing argument, an unknown option) come out as one line too, and an unexpected
exception as one line naming it (RATCHET_DEBUG=1 shows the traceback instead).
"""

from __future__ import annotations

import gzip
import io
import os
import sys
import tokenize
import zlib
from pathlib import Path
from typing import Any, NoReturn

import typer
from typer.core import TyperGroup

BAD_INPUT, CHECK_FAILED = 2, 1


def message(what: str, where: object = None) -> str:
    return f"error: {what}" + (f" ({where})" if where not in (None, "") else "")


def fail(what: str, where: object = None, code: int = BAD_INPUT) -> NoReturn:
    """Print `error: what (where)` on stderr and exit with `code`."""
    typer.echo(message(what, where), err=True)
    raise typer.Exit(code)


def require_model_dir(path: Path) -> None:
    """Fail in one line unless `path` is a model directory `load_policy` loads (preflight's
    check_model_dir, nothing loaded): transformers' own errors run to pages, or a table."""
    from ratchet.preflight import check_model_dir

    problems = check_model_dir(str(path))
    if problems:
        fail("; ".join(p.removeprefix(f"model.path {str(path)!r}: ") for p in problems), path)


def read_bytes(path: Path, what: str = "file") -> bytes:
    """The bytes of a regular file, or fail naming why not (missing, a directory, unreadable)."""
    path = Path(path)
    if not path.exists():
        fail(f"no such {what}", path)
    if path.is_dir():
        fail(f"{what} is a directory, expected a file", path)
    try:
        return path.read_bytes()
    except OSError as e:
        fail(f"cannot read {what}: {e.strerror or e}", path)


def read_text(path: Path, what: str = "file", data: bytes | None = None) -> str:
    """A UTF-8 text file (gunzipped if it ends in .gz; a leading BOM, as Windows editors write, dropped),
    or fail naming why not. `data`: its bytes, already read."""
    path = Path(path)
    data = read_bytes(path, what) if data is None else data
    if path.suffix.lower() == ".gz":     # as source_suffix reads a name: TASKS.JSONL.GZ is gzip too
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            fail(f"{what} is not a readable gzip file: {e}", path)
    if b"\x00" in data:
        fail(f"{what} is a binary file, expected text", path)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        fail(f"{what} is not UTF-8 text: {_where_in(data, e)}", path)


def _where_in(data: bytes, e: UnicodeDecodeError) -> str:
    line = data.count(b"\n", 0, e.start) + 1
    return f"byte 0x{data[e.start]:02x} at line {line}"


def read_python(path: Path) -> str:
    """Python source as the interpreter would decode it (PEP 263 coding line, else UTF-8)."""
    data = read_bytes(path, "Python file")
    if b"\x00" in data:
        fail("a binary file, expected Python source", path)
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as e:           # a bad coding line, or undecodable bytes in the first two lines
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as u:
            fail(f"not utf-8 text: {_where_in(data, u)}", path)
        fail(f"not Python source text: {str(e).splitlines()[0]}", path)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        fail(f"not {encoding} text: {_where_in(data, e)}", path)
    except LookupError:
        fail(f"unknown source encoding {encoding!r}", path)


class OneLineErrors(TyperGroup):
    """The root group: usage errors and unexpected exceptions as one `error:` line."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        try:
            code = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.Abort:
            typer.echo("error: aborted", err=True)
            sys.exit(1)
        except typer.TyperException as e:   # click's errors, as typer vendors them: usage, bad parameter
            if type(e).__name__ == "NoArgsIsHelpError":     # the help is already printed
                sys.exit(BAD_INPUT)
            ctx = getattr(e, "ctx", None)
            typer.echo(message(e.format_message().replace("\n", " "), ctx.command_path if ctx else "ratchet"), err=True)
            sys.exit(getattr(e, "exit_code", BAD_INPUT))
        except Exception as e:  # the last guard: a bug or an unforeseen failure, still one line
            if os.environ.get("RATCHET_DEBUG"):
                raise
            command = " ".join(["ratchet", *[a for a in argv[:2] if not a.startswith("-")]])
            why = (str(e).splitlines() or [""])[0][:300]
            typer.echo(message(f"{type(e).__name__}: {why}", f"{command}; RATCHET_DEBUG=1 shows the traceback"),
                       err=True)
            sys.exit(CHECK_FAILED)
        sys.exit(code if isinstance(code, int) else 0)
