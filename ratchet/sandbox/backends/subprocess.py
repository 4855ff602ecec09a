"""The plain fallback: a fresh `python -I -S` per run in a host temp dir, as a per-slot
unprivileged uid, in its own session, with rlimits, a wall timer, a kill of the process
group and of everything the slot's uid still runs, and the slot's cgroup where writable.

No namespaces: the payload sees the host filesystem (read-only to it only by file
permissions) and the network. Use it where nothing better exists, never for untrusted code
on a machine that matters."""
from __future__ import annotations

from . import register
from ._host_run import HostRunSlot
from .. import host
from ..model import Limits


class SubprocessBackend:
    name = "subprocess"

    def __init__(self, limits: Limits):
        self.limits = limits
        cg = host.cgroups()
        self.mechanisms = {
            "isolation": "none (own session, unprivileged uid; host filesystem and network visible)",
            "uid": "per-slot unprivileged uid",
            "cpu": "RLIMIT_CPU",
            "wall": "timer + kill of the process group and of the slot uid's processes",
            "memory": "RLIMIT_AS" + (" + memory cgroup v1" if "memory" in cg else ""),
            "pids": ("pids cgroup v1 + " if "pids" in cg else "") + "RLIMIT_NPROC on the slot uid",
            "fsize": "RLIMIT_FSIZE", "nofile": "RLIMIT_NOFILE", "output": "capped pipes",
        }

    def new_slot(self) -> HostRunSlot:
        return HostRunSlot(self.limits)

    def close(self) -> None:
        pass


def _unavailable() -> str | None:
    return None  # always available; without root it runs as the caller's uid


register("subprocess", SubprocessBackend, _unavailable)
