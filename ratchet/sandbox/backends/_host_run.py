"""Shared by the backends that exec a fresh process per run from the caller (subprocess,
bwrap): a host temp dir for the workdir, a unique uid, optional slot cgroup, wait4."""
from __future__ import annotations

import ctypes
import os
import resource
import shutil
import signal
import tempfile
import time

from .. import host, lease
from .._io import Pump, build_result
from ..model import DEFAULT_PATH, Limits, Payload, RunResult

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
BOOT_SRC = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "_boot.py")).read()
ENV_PATH = DEFAULT_PATH


def set_rlimits(limits: Limits, nproc: bool) -> None:
    """Called in the child before exec (or before running the payload in the zygote)."""
    cpu = max(1, int(-(-limits.cpu_s // 1)))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    mem = limits.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    fs = limits.fsize_mb * 2**20
    resource.setrlimit(resource.RLIMIT_FSIZE, (fs, fs))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.nofile, limits.nofile))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if nproc:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_procs, limits.max_procs))


def write_tree(root: str, payload: Payload, uid: int, owner: int = 0) -> None:
    """Seed `root` (the workdir): dirs owned by `owner` 1777 (sticky: the payload may add files
    but not remove or replace the read-only ones), writable files owned by `uid`, read-only files
    owned by `owner` 0444. `owner` must never be the payload's (host) uid, or the payload owns
    the sticky dirs and may rename them (the bwrap backend passes the slot uid: see there)."""
    def own_dir(d: str) -> None:
        os.chmod(d, 0o1777)
        if owner:
            os.chown(d, owner, owner)
    own_dir(root)
    for rel, data, ro in payload.all_files():
        path = os.path.join(root, rel)
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            os.makedirs(parent, exist_ok=True)
            d = parent
            while d != root:
                own_dir(d)
                d = os.path.dirname(d)
        if os.path.lexists(path):
            os.unlink(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444 if ro else 0o644)
        try:
            os.write(fd, data)
            if not ro:
                os.fchown(fd, uid, uid)
            elif owner:                  # (owner 0: root's already, as created)
                os.fchown(fd, owner, owner)
        finally:
            os.close(fd)


def interpreter_argv(payload: Payload, ev_fd: int, workdir: str, codefile: str,
                     python: str | None = None) -> list[str]:
    """[python, flags..., -c BOOT, ...]: the boot reports events, then runs the payload.
    A `program` payload is exec'd as it is (no boot, no audit hook)."""
    if payload.code is None and not payload.argv:
        return list(payload.program)
    python = python or payload.python or host.host_python()
    flags = ["-I"] + ([] if payload.site else ["-S"])
    if payload.code is not None:
        return [python, *flags, "-c", BOOT_SRC, str(ev_fd), workdir, "codefile", codefile]
    if payload.argv[0] in ("-m", "-c") or not payload.argv[0].startswith("-"):
        return [python, *flags, "-c", BOOT_SRC, str(ev_fd), workdir, "argv", *payload.argv]
    return [python, *flags, *payload.argv]  # other interpreter flags: run as given, no boot


def minimal_env(workdir: str, tmp: str, payload: Payload | None = None) -> dict[str, str]:
    env = {"PATH": ENV_PATH, "HOME": workdir, "TMPDIR": tmp, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
    return {**env, **(payload.env if payload is not None else {})}


class HostRunSlot:
    """One slot: builds the workdir on the host, spawns, pumps, waits, cleans up."""

    mode = "subprocess"
    check_members = True   # after the main process is reaped, any cgroup member is a leftover

    pids_slack = 0   # pids the cgroup must allow beyond max_procs (see the bwrap backend)

    def __init__(self, limits: Limits, use_cgroup: bool = True):
        self.limits = limits
        self.root = os.geteuid() == 0
        self.uid = host.alloc_uid() if self.root else os.getuid()
        self.cg = host.SlotCgroup(f"slot-{os.getpid()}-{self.uid}", limits.max_procs, limits.memory_mb, self.pids_slack) if (
            use_cgroup and self.root and host.cgroups()) else None

    def spawn_argv(self, payload: Payload, base: str, workdir: str, ev_fd: int) -> tuple[list[str], dict]:
        """(argv, env); the child starts in `workdir`. Subclasses wrap it (bwrap)."""
        python, self._drop = self.python_for(payload)
        argv = interpreter_argv(payload, ev_fd, workdir, os.path.join(base, "main.py"))
        if payload.program and payload.code is None and not payload.argv:
            return argv, minimal_env(workdir, os.path.join(base, "tmp"), payload)
        return [python, *argv[1:]], minimal_env(workdir, os.path.join(base, "tmp"), payload)

    def tree_owners(self) -> tuple[int, int]:
        """(uid of the payload's writable files, owner of the dirs and read-only files): the
        payload runs as the first and must never be the second."""
        return self.uid, 0

    def python_for(self, payload: Payload) -> tuple[str, bool]:
        """(interpreter, drop_uid): as root, an interpreter the slot uid cannot reach (under a
        0700 home) runs as root instead, still in its session, rlimits and cgroup."""
        python = payload.python or host.host_python()
        if not self.root or host.reachable_by_others(python):
            return python, self.root
        if payload.python is None and host.public_python():
            return host.public_python(), True
        return python, False

    def child_setup(self) -> None:
        """In the forked child, before exec: new session, cgroup, rlimits, drop to the slot uid."""
        os.setsid()
        if self.cg:
            for p in self.cg.procs_files():
                fd = os.open(p, os.O_WRONLY)
                os.write(fd, b"0")
                os.close(fd)
        set_rlimits(self.limits, nproc=self._drop)
        if self._drop:
            os.setgroups([])
            os.setresgid(self.uid, self.uid, self.uid)
            os.setresuid(self.uid, self.uid, self.uid)
        # Die with the worker: set after the uid drop, which clears it; the parent may already be gone.
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != self._parent:
            os._exit(137)

    def run(self, payload: Payload) -> RunResult:
        t0 = time.monotonic()
        try:
            base = tempfile.mkdtemp(prefix="ratchet-sbx-")
        except OSError as e:
            return RunResult.infra(f"cannot create workdir: {e}")
        try:
            return self._run(payload, base, t0)
        finally:
            shutil.rmtree(base, ignore_errors=True)

    def _run(self, payload: Payload, base: str, t0: float) -> RunResult:
        os.chmod(base, 0o755)
        workdir, tmp = os.path.join(base, "work"), os.path.join(base, "tmp")
        os.mkdir(workdir)
        os.mkdir(tmp, 0o1777)
        os.chmod(tmp, 0o1777)
        write_tree(workdir, payload, *self.tree_owners())
        if payload.code is not None:
            with open(os.path.join(base, "main.py"), "w", encoding="utf-8") as f:
                f.write(payload.code)
        ev_r, ev_w = os.pipe()
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        if self.cg:
            self.cg.reset_peak()
            before = self.cg.counters()
        argv, env = self.spawn_argv(payload, base, workdir, ev_w)
        self._parent = os.getpid()
        try:
            pid = _spawn(argv, workdir, env, in_r, out_w, err_w, ev_w, self.child_setup)
        except OSError as e:
            for fd in (ev_r, ev_w, in_r, in_w, out_r, out_w, err_r, err_w):
                os.close(fd)
            return RunResult.infra(f"could not start the sandbox ({self.mode}): {e}")
        for fd in (ev_w, in_r, out_w, err_w):
            os.close(fd)
        held = lease.take(pid, self.limits.wall_s, self.uid if self._drop else None)
        try:
            return self._wait(payload, argv, pid, pump_fds=(out_r, err_r, ev_r, in_w), t0=t0,
                              before=before if self.cg else None)
        finally:
            held.release()

    def _wait(self, payload: Payload, argv: list[str], pid: int, pump_fds, t0: float, before) -> RunResult:
        out_r, err_r, ev_r, in_w = pump_fds
        pidfd = os.pidfd_open(pid)

        def kill(_reason: str) -> None:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass

        pump = Pump(out_r, err_r, ev_r, in_w, payload.stdin, self.limits.output_bytes,
                    t0 + self.limits.wall_s, kill)
        try:
            if not pump.run(pidfd):
                kill("stuck")                # SIGKILL always ends it; wait4 below returns
            _, status, ru = os.wait4(pid, 0)
        finally:
            os.close(pidfd)
        wall_ms = (time.monotonic() - t0) * 1000
        try:
            os.killpg(pid, signal.SIGKILL)   # anything left in its session
        except OSError:
            pass
        events = []
        if self.cg and self.check_members and self.cg.members():
            events.append("daemon_left")
        self.after_run()
        pump.read_available()
        spawned = "process_spawn" in pump.events() or "-c" not in argv or bool(payload.program)
        if self._drop and (spawned or events):
            host.sweep_uid(self.uid)         # anything that left the session (a fork per sweep)
        if not pump.drain():
            events.append("output_held_open")
            if self._drop:
                host.sweep_uid(self.uid)
                pump.drain(0.5)
        events = pump.events() + events
        extra = None
        cpu_ms = (ru.ru_utime + ru.ru_stime) * 1000
        # ru_maxrss counts the pages the child inherited from this (possibly large) process at
        # fork, before exec: the slot cgroup's peak, which counts only the run's own charges,
        # is the truer figure where there is one.
        peak = ru.ru_maxrss / 1024
        if self.cg:
            after = self.cg.counters()
            cpu_ms = max(cpu_ms, (after["cpu_ns"] - before["cpu_ns"]) / 1e6)
            if after["pids_max"] > before["pids_max"]:
                events.append("fork_limit")
            if after["oom_kill"] > before["oom_kill"]:
                extra = "memory"
            peak = after["peak"] / 2**20
        status = self.translate_status(status)
        if extra is None and "fork_limit" in events and not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
            extra = "pids"
        return build_result(self.limits, status, pump, wall_ms, cpu_ms, peak, events, extra)

    def translate_status(self, status: int) -> int:
        return status

    def after_run(self) -> None:
        """Kill what the run left behind (subclasses add their own sweep)."""

    def close(self) -> None:
        if self.cg:
            self.cg.remove()


def _spawn(argv, cwd, env, stdin, stdout, stderr, keep_fd, setup) -> int:
    """fork + exec with fds 0,1,2 and keep_fd; errors in the child come back as OSError."""
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(err_r)
            os.dup2(stdin, 0)
            os.dup2(stdout, 1)
            os.dup2(stderr, 2)
            os.set_inheritable(keep_fd, True)
            os.closerange(3, keep_fd)
            os.closerange(keep_fd + 1, err_w)
            os.closerange(err_w + 1, 65536)
            os.chdir(cwd)
            setup()
            os.execve(argv[0], argv, env)
        except BaseException as e:
            try:
                os.write(err_w, f"{type(e).__name__}: {e}".encode()[:1000])
            finally:
                os._exit(127)
    os.close(err_w)
    msg = os.read(err_r, 1000)
    os.close(err_r)
    if msg:
        os.waitpid(pid, 0)
        raise OSError(msg.decode(errors="replace"))
    return pid
