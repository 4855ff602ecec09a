"""Environment consistency: a task's `environment_config` -> the interpreter it runs under.

    python = resolve(EnvironmentConfig(dependencies=("pytest==9.2.0",)))
    verify_many(items, limits, runtime_python=resolve)

Each distinct (runtime, dependency set) becomes one virtual environment under the cache
directory, keyed by the sha256 of the set, built once with pip from the configured package
index and then made read-only (the sandbox mounts it read-only as well), so training, audit
and evaluation all run exactly the same versions. An unsatisfiable set raises
`RuntimeUnavailable` naming the set and pip's own complaint; a runtime the worker does not have
raises it naming the runtime asked for and those available (`available_runtimes`: python3.X
interpreters on PATH that really run). The verifier turns either into an env_error for the tasks
that need it, never a crash of the wave nor a model failure. A failed build is remembered for the
life of the process, so a wave asks pip once, not once per task.

Before the tasks run, `ensure_runtimes(specs, store)` builds every distinct set once (the audit
task calls it) and records each in the store as `envs/runtimes/<key>.json`: runtime,
dependencies, interpreter, the installed distributions (name==version, as pip freeze), or the
error.

Cache directory: $RATCHET_RUNTIMES, else ~/.cache/ratchet/runtimes.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from envs.spec import EnvironmentConfig, TaskSpec


class RuntimeUnavailable(RuntimeError):
    """The environment cannot be built here (interpreter missing, dependencies unsatisfiable)."""


_FAILED: dict[str, str] = {}


def cache_root() -> Path:
    """Where runtimes live. Not under /tmp: the sandbox gives every run a fresh /tmp of its own,
    so a runtime there could not be mounted into it."""
    root = Path(os.environ.get("RATCHET_RUNTIMES") or Path.home() / ".cache" / "ratchet" / "runtimes").absolute()
    if root == Path("/tmp") or Path("/tmp") in root.parents:
        raise RuntimeUnavailable(f"runtime cache {root} is under /tmp, which the sandbox replaces; set RATCHET_RUNTIMES elsewhere")
    return root


def env_key(env: EnvironmentConfig) -> str:
    """sha256 of the runtime and the (sorted, whitespace-free) dependency set."""
    deps = sorted({d.replace(" ", "") for d in env.dependencies})
    return hashlib.sha256(json.dumps([env.runtime, deps]).encode()).hexdigest()[:20]


def _mine() -> str:
    return f"python{sys.version_info.major}.{sys.version_info.minor}"


@functools.lru_cache(maxsize=None)
def _version_of(path: str) -> str | None:
    """"python3.X" if `path` runs and is CPython 3.X (a pyenv shim that fails is no interpreter)."""
    try:
        out = subprocess.run([path, "-I", "-S", "-c", "import sys; print('python%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def available_runtimes() -> dict[str, str]:
    """{"python3.X": interpreter} for this process's own version and every python3.X on PATH that runs."""
    found = {_mine(): getattr(sys, "_base_executable", None) or sys.executable}
    for d in os.environ.get("PATH", "").split(os.pathsep):
        try:
            names = sorted(os.listdir(d)) if d else []
        except OSError:
            continue
        for name in names:
            path = os.path.join(d, name)
            if re.fullmatch(r"python3\.\d+", name) and name not in found and os.access(path, os.X_OK):
                if _version_of(path) == name:
                    found[name] = path
    return dict(sorted(found.items(), key=lambda kv: [int(x) for x in kv[0][6:].split(".")]))


def base_interpreter(runtime: str) -> str:
    """The interpreter named by `runtime` ("python3.11", "python3"), from this process or PATH;
    RuntimeUnavailable naming the runtime asked for and those available on this worker."""
    if runtime == "python3":
        return getattr(sys, "_base_executable", None) or sys.executable
    have = available_runtimes()
    if runtime in have:
        return have[runtime]
    what = ("is not available on this worker" if re.fullmatch(r"python3\.\d+", runtime)
            else "is not a CPython runtime ('python3' or 'python3.X')")
    raise RuntimeUnavailable(f"runtime {runtime!r} {what}; available here: {', '.join(['python3', *have])}")


def _readonly(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            p = Path(dirpath) / name
            if not p.is_symlink():
                p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _writable(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            p = Path(dirpath) / name
            if not p.is_symlink():
                p.chmod(p.stat().st_mode | stat.S_IWUSR)


def resolve(env: EnvironmentConfig, root: Path | None = None, timeout_s: float = 600) -> str | None:
    """Path of the python of `env`'s virtual environment, building it on first use.
    An environment without dependencies on this interpreter's version needs no venv: None."""
    if not env.dependencies and env.runtime in ("python3", f"python{sys.version_info.major}.{sys.version_info.minor}"):
        return None
    key = env_key(env)
    if key in _FAILED:
        raise RuntimeUnavailable(_FAILED[key])
    root = Path(root) if root else cache_root()
    target = root / key
    python = target / "bin" / "python"
    if (target / ".complete").exists():
        return str(python)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # one builder per set, across processes
        if (target / ".complete").exists():
            return str(python)
        try:
            _build(env, target, timeout_s)
        except RuntimeUnavailable as e:
            _FAILED[key] = str(e)
            raise
    return str(python)


def _build(env: EnvironmentConfig, target: Path, timeout_s: float) -> None:
    """Build the venv at its final path (its console scripts, e.g. pytest, name their interpreter
    by path); `.complete` is written last, and a half-built one (no `.complete`) is rebuilt."""
    base = base_interpreter(env.runtime)
    if target.exists():
        _writable(target)
        shutil.rmtree(target)
    # no pip inside the runtime (it is read-only anyway): this process's pip installs into it
    subprocess.run([base, "-m", "venv", "--without-pip", str(target)], check=True, capture_output=True, timeout=120)
    if env.dependencies:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(target / "bin" / "python"), "install", "-q",
             "--disable-pip-version-check", "--no-input", *env.dependencies],
            capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            shutil.rmtree(target, ignore_errors=True)
            why = [re.sub(r" \(from versions:.*?\)", "", ln) for ln in proc.stderr.splitlines() if ln.startswith("ERROR")]
            why = why or proc.stderr.splitlines()[-3:]
            raise RuntimeUnavailable(f"cannot build runtime {env.runtime} with {list(env.dependencies)}: "
                                     + " | ".join(why)[:500])
    (target / ".complete").write_text(json.dumps({"runtime": env.runtime, "dependencies": list(env.dependencies)}))
    _readonly(target)


@dataclass(frozen=True)
class Built:
    """One distinct (runtime, dependencies) set after `ensure_runtimes`."""

    key: str
    env: EnvironmentConfig
    python: str | None = None     # the venv's python; None: the sandbox's own interpreter (or the build failed)
    error: str | None = None      # why it could not be built (its tasks become env_errors)
    freeze: tuple[str, ...] = ()  # name==version of every installed distribution

    def manifest(self) -> dict:
        return {"key": self.key, "runtime": self.env.runtime, "dependencies": list(self.env.dependencies),
                "python": self.python, "error": self.error, "freeze": list(self.freeze)}


def freeze(python: str) -> tuple[str, ...]:
    """name==version of every distribution `python` sees (what `pip freeze` lists, without pip)."""
    src = ("import json, importlib.metadata as m; "
           "print(json.dumps(sorted({d.metadata['Name'] + '==' + d.version for d in m.distributions()})))")
    out = subprocess.run([python, "-I", "-c", src], capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    return tuple(json.loads(out.stdout)) if out.returncode == 0 else ()


def ensure_runtimes(specs: list[TaskSpec], store=None, root: Path | None = None) -> dict[str, Built]:
    """Build every distinct environment of `specs` once, before any of their tasks runs; record
    each in `store` (an ArtifactStore) as envs/runtimes/<key>.json. A set that cannot be built is
    returned (and recorded) with its error, never raised: its tasks become env_errors, named."""
    envs = {env_key(s.environment_config): s.environment_config for s in specs}
    out: dict[str, Built] = {}
    for key, env in envs.items():
        try:
            python = resolve(env, root=root)
            out[key] = Built(key, env, python, None, freeze(python or base_interpreter(env.runtime)))
        except RuntimeUnavailable as e:
            out[key] = Built(key, env, None, str(e))
        if store is not None:
            store.put_json(f"envs/runtimes/{key}.json", out[key].manifest())
    return out
