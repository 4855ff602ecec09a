"""Call a model-written function on test inputs inside the sandbox, compare outside it.

Comparing results inside the candidate's process is hackable: an object whose `__eq__`
always returns True passes every `==` test. So `call_harness` builds a program that runs
the completion, calls `entry_point` on each argument list, and prints each return value as
*plain data* (JSON text, built by an encoder captured before the completion runs, that
reads builtin values through their C slots and refuses anything that is not a builtin
type). The verifier compares those strings with the reference's, outside the sandbox:

    code = call_harness(completion, "add", ["[1, 2]", "[3, 4]"])
    res = sandbox.run(Payload(code=code))
    got = parse_harness_output(res.stdout, n=2)        # ['3', '7'], None where a call failed
    expected = parse_harness_output(sandbox.run(Payload(code=call_harness(reference, "add", args))).stdout)

Encoding: null/true/false, ints, floats (exact repr; nan/inf as {"$float": "nan"}), strings,
lists; tuples, sets, frozensets, dicts and bytes as tagged objects ({"$tuple": [...]}, sets
and dicts sorted by the encoded key) so `(1, 2)` and `[1, 2]` stay different as in Python.
Arguments may use the same tags (a JSON array of positional arguments whose items may be
{"$tuple": [...]}, {"$set": [...]}, {"$dict": [[k, v], ...]}, {"$float": "inf"}, {"$bytes": hex}):
they are rebuilt as those Python values before the call, so a result recorded from a call
with a tuple or a non-string dict key can be replayed (`envs.importers`, HumanEval).

What the model reads when it fails (the episode's observation): a call that raised prints
"!Type: its message" (on one line, cut at RAISED_MESSAGE_CHARS; never compared, only shown), and an
answer that does not load prints its traceback from its own frames down, with its source lines
(registered with linecache: the answer is compiled from a string), not the harness's.

The program ends with SystemExit(0), which the sandbox's boot turns into its `finish` (as for any
run): a process the answer left behind is noted (`daemon_left`), then os._exit, so no atexit hook or
finalizer of the answer runs after the last line (stdout and stderr are the harness's own again, so
no stream the answer put there is flushed either).

What this does not stop: the completion runs in the same process first, so it can read the
harness's marker and print forged result lines. Forging only helps if it already knows the
expected values (which the verifier keeps outside), and the parser takes the last line per
call, written by the harness after the call returns.
"""
from __future__ import annotations

import json
import re

MARK = "@@ratchet-harness@@"
RAISED_MESSAGE_CHARS = 120      # a call that raised reports "!Type: its message", the message on one line, cut here

_TEMPLATE = r'''
import sys as _s, os as _o, json as _j, ast as _a
def _mk(_type=type, _int=int, _float=float, _str=str, _bool=bool, _list=list, _tuple=tuple,
        _dict=dict, _set=set, _fset=frozenset, _bytes=bytes, _issub=issubclass, _sorted=sorted,
        _esc=_j.encoder.encode_basestring_ascii, _join=str.join, _irepr=int.__repr__,
        _frepr=float.__repr__, _sstr=str.__str__, _liter=list.__iter__, _titer=tuple.__iter__,
        _ditems=dict.items, _siter=set.__iter__, _fsiter=frozenset.__iter__, _hex=bytes.hex,
        _bcopy=bytes.__bytes__ if hasattr(bytes, "__bytes__") else bytes):
    def enc(x, d=0):
        if d > 100:
            raise ValueError("too deep")
        t = _type(x)
        if x is None:
            return "null"
        if t is _bool:
            return "true" if x is True else "false"
        if _issub(t, _bool):
            raise TypeError("bool subclass")
        if _issub(t, _int):
            return _irepr(x)
        if _issub(t, _float):
            r = _frepr(x)
            return r if r not in ("nan", "inf", "-inf") else '{"$float":"%s"}' % r
        if _issub(t, _str):
            return _esc(_sstr(x))
        if _issub(t, _list):
            return "[" + _join(",", [enc(v, d + 1) for v in _liter(x)]) + "]"
        if _issub(t, _tuple):
            return '{"$tuple":[' + _join(",", [enc(v, d + 1) for v in _titer(x)]) + "]}"
        if _issub(t, _dict):
            items = _sorted([(enc(k, d + 1), enc(v, d + 1)) for k, v in _ditems(x)])
            return '{"$dict":[' + _join(",", ["[%s,%s]" % kv for kv in items]) + "]}"
        if _issub(t, _set) or _issub(t, _fset):
            it = _siter(x) if _issub(t, _set) else _fsiter(x)
            return '{"$set":[' + _join(",", _sorted([enc(v, d + 1) for v in it])) + "]}"
        if _issub(t, _bytes):
            return '{"$bytes":"%s"}' % _hex(x)
        raise TypeError("not plain data: " + t.__name__)
    return enc
_enc = _mk()
_w, _loads, _lit, _stop, _flush_o, _flush_e, _text = _o.write, _j.loads, _a.literal_eval, SystemExit, _s.stdout.flush, _s.stderr.flush, str
_streams = (_s.stdout, _s.stderr)
_M = MARK_
def _out(line):
    try:
        _flush_o(); _flush_e()
    except Exception:
        pass
    b = (line + "\n").encode()
    while b:
        b = b[_w(1, b):]
def _plain(v, d=0):
    if d > 100:
        raise ValueError("too deep")
    if type(v) is list:
        return [_plain(x, d + 1) for x in v]
    if type(v) is dict:
        if len(v) == 1:
            (k, x), = v.items()
            if k == "$tuple":
                return tuple(_plain(y, d + 1) for y in x)
            if k == "$float":
                return float(x)
            if k == "$set":
                return set(_plain(y, d + 1) for y in x)
            if k == "$dict":
                return {_plain(a, d + 1): _plain(b, d + 1) for a, b in x}
            if k == "$bytes":
                return bytes.fromhex(x)
        return {k: _plain(x, d + 1) for k, x in v.items()}
    return v
def _args(s):
    try:
        v = _plain(_loads(s))
    except ValueError:
        v = _lit(s)
    return list(v) if isinstance(v, (list, tuple)) else [v]
_ns = {"__name__": "__main__", "__builtins__": __builtins__}
_ok = True
_src = COMPLETION_
try:
    exec(compile(_src, "solution.py", "exec"), _ns)
except BaseException as _e:
    import traceback as _tb, linecache as _lc
    _lc.cache["solution.py"] = (len(_src), None, _src.splitlines(True), "solution.py")
    _tb.print_exception(type(_e), _e, _e.__traceback__.tb_next); _ok = False
_ARGS = ARGS_
_out(_M + "\tBEGIN\t%d" % len(_ARGS))
for _i, _raw in enumerate(_ARGS):
    if not _ok:
        break
    try:
        _r = _ns[ENTRY_](*_args(_raw))
        _line = _M + "\t%d\t" % _i + _enc(_r)
    except BaseException as _e:
        try:
            _line = _M + "\t%d\t!%s" % (_i, type(_e).__name__)
        except BaseException:
            _line = _M + "\t%d\t!error" % _i
        try:
            _msg = " ".join(_text(_e).split())     # feedback for the model, not a result: never compared
            _line += (": " + _msg[:MSG_] + ("..." if len(_msg) > MSG_ else "")) if _msg else ""
        except BaseException:
            pass
    _out(_line)
_out(_M + "\tEND\t%d" % len(_ARGS))
_s.stdout, _s.stderr = _streams
raise _stop(0)
'''


def call_harness(completion: str, entry_point: str, args_list: list[str]) -> str:
    """Python source that runs `completion`, then prints `entry_point(*args)` as plain-data
    JSON for each args in args_list (each a JSON array of positional arguments, or a Python
    literal list/tuple), one marked line per call."""
    values = {"MARK_": repr(MARK), "MSG_": str(RAISED_MESSAGE_CHARS), "COMPLETION_": repr(completion),
              "ARGS_": repr([str(a) for a in args_list]), "ENTRY_": repr(entry_point)}
    # one pass: what is filled in is not searched again (an answer that says "ARGS_" stays as written)
    return re.sub(r"\b(?:MARK|MSG|COMPLETION|ARGS|ENTRY)_\b", lambda m: values[m.group(0)], _TEMPLATE)


def parse_harness_output(stdout: str, n: int | None = None) -> list[str | None]:
    """Per-call JSON result strings from a harness run's stdout; None where a call raised,
    returned something that is not plain data, or never ran. `n` pads to the expected count
    (e.g. when the completion failed to import, no BEGIN line is printed)."""
    count, results = None, {}
    for line in stdout.splitlines():
        if not line.startswith(MARK + "\t"):
            continue
        parts = line.split("\t", 2)
        if len(parts) != 3:
            continue
        if parts[1] == "BEGIN":
            count, results = _int(parts[2]), {}
        elif parts[1] != "END" and count is not None:
            i = _int(parts[1])
            if i is not None and 0 <= i < count:
                results[i] = None if parts[2].startswith("!") else _valid_json(parts[2])
    size = n if n is not None else (count or 0)
    return [results.get(i) for i in range(size)]


def _int(s: str) -> int | None:
    try:
        return int(s)
    except ValueError:
        return None


def _valid_json(s: str) -> str | None:
    try:
        json.loads(s)
        return s
    except (ValueError, RecursionError):   # a line the answer printed itself may nest 20,000 deep
        return None
