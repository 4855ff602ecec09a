"""The reference backend: one `bwrap` (bubblewrap, Debian package `bubblewrap`) per run.

Fresh user, pid, mount, net, ipc, uts (and cgroup) namespaces; a tmpfs /tmp with the run's
workdir bound at /tmp/work; read-only binds of /usr and the interpreter's prefixes; bwrap's
minimal /dev and its own /proc for the run's pid namespace; no network; every capability
dropped; bwrap's init as pid 1 (killing it ends the run). bwrap runs as root here (it must
reach interpreters under a 0700 home), so the payload's uid maps to root outside the
namespace: RLIMIT_NPROC cannot bound it, and the slot's pids cgroup does (where writable).

Read-only payload files are read-only bind mounts, and the payload owns neither them nor the
sticky 1777 dirs that hold them: those belong to the slot's uid (never the payload's, which
is root outside), the payload's own writable files to root. As on the zygote backend, the
payload may add files anywhere in the tree but cannot modify, remove, rename or replace a
read-only file or a dir that holds one (the sticky bit; no capability overrides it: the
slot uid is not even mapped in the namespace). Were the dirs root's, the payload would own
them and could rename `tests/` away and put its own in its place."""
from __future__ import annotations

import os
import signal

from . import register
from ._host_run import HostRunSlot, interpreter_argv, minimal_env
from .. import host
from ..model import Limits, Payload


class BwrapSlot(HostRunSlot):
    mode = "bwrap"
    # The kernel releases the pids-cgroup charge of an ended pid namespace's init seconds
    # later, so back-to-back bwrap runs pile up stale charges: allow for them.
    pids_slack = 64
    check_members = False  # bwrap's own init may still be exiting when the outer bwrap is reaped

    def tree_owners(self) -> tuple[int, int]:
        return 0, self.uid   # the payload is root outside the namespace: see the docstring

    def spawn_argv(self, payload: Payload, base: str, workdir: str, ev_fd: int) -> tuple[list[str], dict]:
        python = payload.python or host.host_python()
        args = [host.bwrap(), "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                "--uid", "1000", "--gid", "1000", "--hostname", "sandbox", "--ro-bind", "/usr", "/usr",
                # /tmp first: an interpreter prefix under /tmp (a checkout in /tmp) is bound over it below
                "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
        for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            p = "/" + top
            if os.path.islink(p):
                args += ["--symlink", os.readlink(p), p]
            elif os.path.isdir(p):
                args += ["--ro-bind", p, p]
        for prefix in host.python_prefixes(python):
            if not prefix.startswith("/usr/"):
                args += ["--ro-bind", prefix, prefix]
        if os.path.exists("/etc/ld.so.cache"):
            args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        args += ["--bind", workdir, "/tmp/work", "--symlink", "/tmp/work", "/app"]
        for rel in payload.readonly_files:
            rel = os.path.normpath(rel)
            args += ["--ro-bind", os.path.join(workdir, rel), os.path.join("/tmp/work", rel)]
        if payload.code is not None:
            args += ["--ro-bind", os.path.join(base, "main.py"), "/tmp/.main.py"]
        args += ["--remount-ro", "/", "--chdir", "/tmp/work", "--"]
        self._drop = False     # bwrap itself needs root to reach the interpreter; see docstring
        argv = interpreter_argv(payload, ev_fd, "/tmp/work", "/tmp/.main.py", python=python)
        return args + argv, minimal_env("/tmp/work", "/tmp", payload)

    def translate_status(self, status: int) -> int:
        """bwrap exits 128+N when its child died of signal N: give back a signal status."""
        if os.WIFEXITED(status) and 128 < os.WEXITSTATUS(status) < 128 + 65:
            return os.WEXITSTATUS(status) - 128
        return status

    def after_run(self) -> None:
        if self.cg:
            for pid in self.cg.members():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


class BwrapBackend:
    name = "bwrap"

    def __init__(self, limits: Limits):
        self.limits = limits
        cg = host.cgroups()
        self.mechanisms = {
            "isolation": "bwrap: fresh user, pid, mount, net, ipc, uts, cgroup namespaces; read-only binds; "
                         "tmpfs /tmp; no network; all capabilities dropped",
            "uid": "1000 inside a user namespace mapped to root outside (bwrap runs as root)",
            "cpu": "RLIMIT_CPU",
            "wall": "timer + SIGKILL of bwrap (its init dies with it, and the whole pid namespace)",
            "memory": "RLIMIT_AS" + (" + memory cgroup v1 (per slot)" if "memory" in cg else ""),
            "pids": "pids cgroup v1 (per slot; +64 slack for stale pid-namespace charges)" if "pids" in cg else "NONE (no writable pids cgroup; "
                    "RLIMIT_NPROC does not bind a root-mapped uid)",
            "fsize": "RLIMIT_FSIZE (each file; no total: the workdir is a host temp dir, /tmp an unsized tmpfs)",
            "nofile": "RLIMIT_NOFILE", "output": "capped pipes",
        }

    def new_slot(self) -> BwrapSlot:
        return BwrapSlot(self.limits)

    def close(self) -> None:
        pass


def _unavailable() -> str | None:
    if not host.bwrap():
        return "the bwrap binary is not installed (apt-get install bubblewrap)"
    if os.geteuid() != 0:
        return "this backend runs bwrap as root (to reach interpreters under 0700 homes)"
    return None


register("bwrap", BwrapBackend, _unavailable)
