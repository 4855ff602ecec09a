"""The sandbox's data types: what a run may use (Limits), what it runs (Payload), what came
back (RunResult). Plain frozen dataclasses, stdlib only, so every backend and the CLI share
them without importing anything heavy."""
from __future__ import annotations

import dataclasses
import posixpath
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

KILLED_BY = ("wall", "cpu", "memory", "pids", "output", "fsize")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
"""PATH inside a run unless the payload's `env` sets its own."""
WORKDIR = "/tmp/work"
"""The run's working directory inside the sandbox (zygote, bwrap); `/app` is a symlink to it."""


@dataclass(frozen=True)
class Limits:
    """Per-run limits. Every backend enforces all of them; `doctor()` says how."""

    cpu_s: float = 2.0
    """CPU seconds per process of the run (RLIMIT_CPU, rounded up to whole seconds; then SIGKILL): a run
    that forks spends up to this much in each process, bounded as a whole by `wall_s` times the cores."""
    wall_s: float = 5.0
    """Wall-clock seconds; then the whole run (its pid namespace / process group) is killed."""
    memory_mb: int = 512
    """Address space per process (RLIMIT_AS) and, where a memory cgroup is writable, the run's total."""
    max_procs: int = 32
    """Processes/threads the run may have at once (pids cgroup, else a per-slot uid + RLIMIT_NPROC)."""
    fsize_mb: int = 16
    """Largest file the run may write (RLIMIT_FSIZE). Only the zygote backend caps a run's total as well: its
    writable tmpfs holds 4x this. On bwrap the workdir is a directory in the host's temp dir and /tmp an
    unsized tmpfs, on subprocess the workdir is in the host's temp dir: each file is capped, not their sum."""
    nofile: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    output_bytes: int = 65536
    """stdout and stderr are each capped here; past it the run is killed and marked truncated."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"Limits.{f.name} must be > 0, got {getattr(self, f.name)!r}")


def _frozen_map(m: Mapping[str, str | bytes] | None) -> Mapping[str, str | bytes]:
    return MappingProxyType(dict(m or {}))


@dataclass(frozen=True)
class Payload:
    """One thing to run. `code` runs as the main program in a fresh working directory."""

    code: str | None = None
    """Python source run as `__main__`, cwd = the fresh workdir."""
    argv: tuple[str, ...] = ()
    """If code is None: run `python <argv...>` in the workdir, e.g. ("-m", "pytest", "-q", "tests")."""
    program: tuple[str, ...] = ()
    """If code is None and argv empty: exec this program (absolute path) and arguments as they are,
    e.g. ("/bin/sh", "-c", "make test | tail -3"); no audit hook runs in it (security_events
    then come from the cgroup counters only). `python` still names the runtime whose prefixes
    are mounted read-only into the run."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Environment variables set for the run on top of the minimal one (PATH, HOME, TMPDIR, LANG)."""
    files: Mapping[str, str | bytes] = field(default_factory=dict)
    """Written into the workdir first: relative paths, subdirectories allowed; text as UTF-8 (surrogatepass)."""
    readonly_files: Mapping[str, str | bytes] = field(default_factory=dict)
    """Written after `files` and not writable (nor removable) by the payload: hidden tests."""
    stdin: bytes = b""
    python: str | None = None
    """Interpreter (e.g. a venv's bin/python). None: the host's python3, isolated (-I -S)."""
    site: bool = False
    """Let `python` see its site-packages (needed for pytest in a venv)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "files", _frozen_map(self.files))
        object.__setattr__(self, "readonly_files", _frozen_map(self.readonly_files))
        object.__setattr__(self, "argv", tuple(self.argv))
        object.__setattr__(self, "program", tuple(self.program))
        object.__setattr__(self, "env", MappingProxyType(dict(self.env or {})))
        if self.code is None and not self.argv and not self.program:
            raise ValueError("Payload needs `code`, `argv` or `program`")
        if self.program and not self.program[0].startswith("/"):
            raise ValueError(f"Payload.program must start with an absolute path, got {self.program[0]!r}")
        for k, v in self.env.items():
            if not (isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v):
                raise ValueError(f"Payload.env: bad variable {k!r}={v!r}")
        if isinstance(self.stdin, str):
            object.__setattr__(self, "stdin", self.stdin.encode())
        for name in (*self.files, *self.readonly_files):
            check_relpath(name)

    @property
    def needs_exec(self) -> bool:
        """True when the payload needs its own interpreter process (not the zygote's)."""
        return self.code is None or self.python is not None or self.site or bool(self.env)

    def all_files(self) -> list[tuple[str, bytes, bool]]:
        """[(relative path, content, readonly)], writable files first."""
        out = [(p, _b(c), False) for p, c in self.files.items()]
        return out + [(p, _b(c), True) for p, c in self.readonly_files.items()]


def _b(c: str | bytes) -> bytes:
    # surrogatepass: a lone surrogate (an answer's text may hold one) has no UTF-8, and strict encoding raised in
    # the slot, an infra error; as these bytes the run reads it as it came (Python refuses it in a string literal)
    return c.encode("utf-8", "surrogatepass") if isinstance(c, str) else bytes(c)


def check_relpath(name: str) -> str:
    """A workdir-relative path, or ValueError: no absolute paths, no `..` escapes."""
    norm = posixpath.normpath(name)
    if not name or name.startswith("/") or norm == "." or norm.startswith("../") or norm == ".." or "\0" in name:
        raise ValueError(f"Payload file path {name!r} must be relative and stay inside the workdir")
    return norm


@dataclass(frozen=True)
class RunResult:
    exit_code: int | None
    signal: int | None
    killed_by: str | None
    """Which limit ended the run: "wall" | "cpu" | "memory" | "pids" | "output" | "fsize" | None."""
    timed_out: bool
    stdout: str
    stderr: str
    truncated: bool
    wall_ms: float
    cpu_ms: float
    peak_memory_mb: float
    security_events: tuple[str, ...] = ()
    """What the payload tried that the sandbox refused or noticed, e.g. "network_attempt"."""
    infra_error: str | None = None
    """The SANDBOX failed (could not start, worker died): not the payload's fault; retry it."""

    @property
    def ok(self) -> bool:
        return self.infra_error is None and self.exit_code == 0 and not self.killed_by

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["security_events"] = list(self.security_events)
        d["ok"] = self.ok
        return d

    @classmethod
    def infra(cls, message: str, wall_ms: float = 0.0) -> "RunResult":
        return cls(exit_code=None, signal=None, killed_by=None, timed_out=False, stdout="",
                   stderr="", truncated=False, wall_ms=wall_ms, cpu_ms=0.0, peak_memory_mb=0.0,
                   security_events=(), infra_error=message)
