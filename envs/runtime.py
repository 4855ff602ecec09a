"""Environment consistency: a task's `environment_config` -> the interpreter it runs under.

    python = resolve(EnvironmentConfig(dependencies=("pytest==9.2.0",)))
    verify_many(items, limits, runtime_python=resolve)

Each distinct (runtime, dependency set) becomes one virtual environment under the cache
directory, keyed by the sha256 of the set, built once with pip from the configured package
index and then made read-only (the sandbox mounts it read-only as well), so training, audit
and evaluation all run exactly the same versions. An unsatisfiable set raises
`RuntimeUnavailable` naming the set and pip's own complaint; the verifier turns that into an
env_error for the tasks that need it, never a crash of the wave. A failed build is remembered
for the life of the process, so a wave asks pip once, not once per task.

Cache directory: $RATCHET_RUNTIMES, else ~/.cache/ratchet/runtimes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from envs.spec import EnvironmentConfig


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


def base_interpreter(runtime: str) -> str:
    """The interpreter named by `runtime` ("python3.11", "python3"), from PATH or this process."""
    if not re.fullmatch(r"python3(\.\d+)?", runtime):
        raise RuntimeUnavailable(f"runtime {runtime!r}: only CPython runtimes 'python3' / 'python3.X' are supported")
    want = runtime.removeprefix("python")
    mine = f"{sys.version_info.major}.{sys.version_info.minor}"
    if want in ("3", mine):
        return getattr(sys, "_base_executable", None) or sys.executable
    found = shutil.which(runtime)
    if not found:
        raise RuntimeUnavailable(f"runtime {runtime!r} is not installed on this machine (this one runs python{mine})")
    return found


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
    base = base_interpreter(env.runtime)
    tmp = target.with_name(target.name + ".build")
    if tmp.exists():
        _writable(tmp)
        shutil.rmtree(tmp)
    # no pip inside the runtime (it is read-only anyway): this process's pip installs into it
    subprocess.run([base, "-m", "venv", "--without-pip", str(tmp)], check=True, capture_output=True, timeout=120)
    if env.dependencies:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(tmp / "bin" / "python"), "install", "-q",
             "--disable-pip-version-check", "--no-input", *env.dependencies],
            capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            why = [re.sub(r" \(from versions:.*?\)", "", ln) for ln in proc.stderr.splitlines() if ln.startswith("ERROR")]
            why = why or proc.stderr.splitlines()[-3:]
            raise RuntimeUnavailable(f"cannot build runtime {env.runtime} with {list(env.dependencies)}: "
                                     + " | ".join(why)[:500])
    (tmp / ".complete").write_text(json.dumps({"runtime": env.runtime, "dependencies": list(env.dependencies)}))
    _readonly(tmp)
    if target.exists():
        _writable(target)
        shutil.rmtree(target)
    tmp.rename(target)
