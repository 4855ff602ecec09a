"""What this host offers the sandbox, detected at start-up (never assumed): user
namespaces, cgroup v1/v2 controllers we may write, bwrap, the host interpreter. Plus the
small per-slot resources every backend uses: a unique unprivileged uid and a cgroup."""
from __future__ import annotations

import functools
import itertools
import os
import shutil
import subprocess
import sys
import threading

CG_ROOT = "/sys/fs/cgroup"
UID_BASE, UID_SPAN = 1_000_000, 1 << 26
_uid_counter = itertools.count()
_uid_lock = threading.Lock()


def alloc_uid() -> int:
    """A uid no other live slot uses (pid-derived), so RLIMIT_NPROC counts one run only."""
    with _uid_lock:
        n = next(_uid_counter) & 1023
    return UID_BASE + ((os.getpid() << 10) | n) % UID_SPAN


@functools.lru_cache(maxsize=None)
def host_python() -> str:
    """The real interpreter behind this process (not a venv or pyenv shim)."""
    exe = getattr(sys, "_base_executable", None) or sys.executable
    real = os.path.realpath(exe)
    if os.access(real, os.X_OK):
        return real
    return os.path.realpath(shutil.which("python3") or "/usr/bin/python3")


@functools.lru_cache(maxsize=None)
def python_prefixes(python: str) -> tuple[str, ...]:
    """Directories `python` needs visible (its prefix, base prefix, the venv dir)."""
    if os.path.abspath(python) == host_python():
        return (sys.base_prefix,)
    out = subprocess.run([python, "-I", "-S", "-c", "import sys; print(sys.prefix); print(sys.base_prefix)"],
                         capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    if out.returncode != 0:
        raise RuntimeError(f"cannot run interpreter {python!r}: {out.stderr.strip()[-300:]}")
    dirs = {os.path.realpath(p) for p in out.stdout.split()}
    venv = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    if os.path.exists(os.path.join(venv, "pyvenv.cfg")):
        dirs.add(venv)
    return tuple(sorted(dirs))


def reachable_by_others(path: str) -> bool:
    """Can an unprivileged uid exec `path` (every directory on the way is o+x)?"""
    real = os.path.realpath(path)
    d = os.path.dirname(real)
    while True:
        try:
            if not os.stat(d).st_mode & 0o001:
                return False
        except OSError:
            return False
        if d == "/":
            break
        d = os.path.dirname(d)
    try:
        return bool(os.stat(real).st_mode & 0o001)
    except OSError:
        return False


@functools.lru_cache(maxsize=None)
def public_python() -> str | None:
    """A python3 of the same minor version that an unprivileged uid can run, if any."""
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for cand in (host_python(), f"/usr/bin/{ver}", f"/usr/local/bin/{ver}"):
        if os.path.exists(cand) and reachable_by_others(cand):
            return os.path.realpath(cand)
    return None


def _cg_v1_writable(ctrl: str) -> bool:
    path = os.path.join(CG_ROOT, ctrl)
    if not os.path.exists(os.path.join(path, "cgroup.procs")) or not os.access(path, os.W_OK):
        return False
    probe = os.path.join(path, f"ratchet-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
        return True
    except OSError:
        return False


@functools.lru_cache(maxsize=None)
def cgroups() -> dict[str, str]:
    """{"pids": dir, "memory": dir} for the writable cgroup v1 controllers (v2 if it has them)."""
    found = {}
    for ctrl in ("pids", "memory", "cpuacct"):
        if _cg_v1_writable(ctrl):
            found[ctrl] = os.path.join(CG_ROOT, ctrl)
    v2 = next((p for p in (CG_ROOT, os.path.join(CG_ROOT, "unified"))
               if os.path.exists(os.path.join(p, "cgroup.controllers"))), None)
    if v2:
        try:
            with open(os.path.join(v2, "cgroup.subtree_control")) as f:
                ctrls = f.read().split()
        except OSError:
            ctrls = []
        for ctrl in ("pids", "memory"):
            if ctrl not in found and ctrl in ctrls and os.access(v2, os.W_OK):
                found[ctrl] = v2 + ":v2"
    return found


@functools.lru_cache(maxsize=None)
def userns() -> bool:
    """Can a process create user (and the other) namespaces here?"""
    unshare = shutil.which("unshare")
    if not unshare:
        return False
    try:
        r = subprocess.run([unshare, "-U", "-p", "-n", "-m", "-i", "-u", "-f", "true"],
                           capture_output=True, timeout=10)
        return r.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def bwrap() -> str | None:
    return shutil.which("bwrap")


_swept = False


def sweep_stale_cgroups() -> None:
    """Remove slot cgroups left by dead processes (names carry the owner's pid); once per process."""
    global _swept
    if _swept:
        return
    _swept = True
    for base in cgroups().values():
        parent = os.path.join(base, "ratchet-sandbox")
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            parts = name.split("-")
            if len(parts) == 3 and parts[1].isdigit() and not os.path.exists(f"/proc/{parts[1]}"):
                try:
                    os.rmdir(os.path.join(parent, name))
                except OSError:
                    pass


class SlotCgroup:
    """A cgroup v1 (pids + memory) for one worker slot; runs in a slot are sequential.
    `name` is kind-owner_pid-uid, so a later process can clean up after a killed one."""

    def __init__(self, name: str, max_procs: int, memory_mb: int, extra_procs: int = 0):
        sweep_stale_cgroups()
        self.dirs: dict[str, str] = {}
        self._fds: dict[tuple[str, str], int] = {}
        for ctrl, base in cgroups().items():
            if base.endswith(":v2"):
                continue  # this host's v2 mount has no pids/memory controllers; v1 handled here
            d = os.path.join(base, "ratchet-sandbox", name)
            os.makedirs(d, exist_ok=True)
            self.dirs[ctrl] = d
        if "pids" in self.dirs:
            self._write("pids", "pids.max", str(max_procs + extra_procs))
        if "memory" in self.dirs:
            limit = (memory_mb + 64) * 2**20  # the run's total, plus the slot's worker
            self._write("memory", "memory.limit_in_bytes", str(limit))
            try:
                self._write("memory", "memory.memsw.limit_in_bytes", str(limit))
            except OSError:
                pass

    def _write(self, ctrl: str, name: str, value: str) -> None:
        with open(os.path.join(self.dirs[ctrl], name), "w") as f:
            f.write(value)

    def _read(self, ctrl: str, name: str) -> str:
        """Read a cgroup file through a kept-open fd (a run reads three of them twice)."""
        key = (ctrl, name)
        try:
            fd = self._fds.get(key)
            if fd is None:
                fd = self._fds[key] = os.open(os.path.join(self.dirs[ctrl], name), os.O_RDONLY | os.O_CLOEXEC)
            return os.pread(fd, 4096, 0).decode()
        except (OSError, KeyError):
            return ""

    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs.values()]

    def join(self, pid: int = 0) -> None:
        for p in self.procs_files():
            with open(p, "w") as f:
                f.write(str(pid))

    def counters(self) -> dict[str, int]:
        """pids.events max, memory oom kills, memory peak bytes."""
        out = {}
        ev = self._read("pids", "pids.events").split()
        out["pids_max"] = int(ev[ev.index("max") + 1]) if "max" in ev else 0
        oc = self._read("memory", "memory.oom_control").split()
        out["oom_kill"] = int(oc[oc.index("oom_kill") + 1]) if "oom_kill" in oc else 0
        peak = self._read("memory", "memory.max_usage_in_bytes").strip()
        out["peak"] = int(peak) if peak else 0
        cpu = self._read("cpuacct", "cpuacct.usage").strip()
        out["cpu_ns"] = int(cpu) if cpu else 0
        return out

    def reset_peak(self) -> None:
        if "memory" in self.dirs:
            try:
                fd = self._fds.get(("memory", "w:max_usage"))
                if fd is None:
                    fd = self._fds[("memory", "w:max_usage")] = os.open(
                        os.path.join(self.dirs["memory"], "memory.max_usage_in_bytes"), os.O_WRONLY | os.O_CLOEXEC)
                os.write(fd, b"0")
            except OSError:
                pass

    def members(self) -> list[int]:
        """Processes in the slot's cgroup now (a fresh open: cgroup.procs does not re-read)."""
        for d in self.dirs.values():
            try:
                with open(os.path.join(d, "cgroup.procs")) as f:
                    return [int(x) for x in f.read().split()]
            except OSError:
                continue
        return []

    def remove(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for d in self.dirs.values():
            try:
                os.rmdir(d)
            except OSError:
                pass


def sweep_uid(uid: int) -> None:
    """Kill every process running as `uid` (a slot's own uid): daemons that left the group."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, 9)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
