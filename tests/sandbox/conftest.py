"""Fixtures: one Sandbox per available backend (module-scoped), small limits so that every
adversarial case ends in about a second."""
import os

import pytest

from ratchet.sandbox import Limits, Sandbox
from ratchet.sandbox.pool import available_backends

# Generous wall clock (this host is shared and often loaded); cases that test the wall clock
# itself use `tight`.
LIMITS = Limits(cpu_s=5.0, wall_s=20.0, memory_mb=256, max_procs=16, fsize_mb=4, nofile=32, output_bytes=8192)
TIGHT = Limits(cpu_s=1.0, wall_s=2.0, memory_mb=256, max_procs=16, fsize_mb=4, nofile=32, output_bytes=8192)
BACKENDS = ["zygote", "bwrap", "subprocess"]
ISOLATING = {"zygote", "bwrap"}   # backends with namespaces (the subprocess fallback has none)


def processes_named(comm: str) -> list[str]:
    """The pids of this machine's processes whose name (`/proc/PID/comm`, set by prctl PR_SET_NAME) is `comm`."""
    out = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and open(f"/proc/{pid}/comm").read().strip() == comm:
                out.append(pid)
        except OSError:
            pass
    return out


def need_backend(name: str) -> None:
    """Skip the test, saying why, when sandbox backend `name` cannot run on this machine."""
    why = available_backends().get(name, "unknown backend")
    if why:
        pytest.skip(f"backend {name} unavailable here: {why}")


@pytest.fixture(scope="module", params=BACKENDS)
def sb(request):
    need_backend(request.param)
    with Sandbox(LIMITS, backend=request.param, concurrency=2) as box:
        yield box


@pytest.fixture
def isolating(sb):
    if sb.backend_name not in ISOLATING:
        pytest.skip(f"{sb.backend_name} backend has no namespaces (documented): nothing to contain this")
    return sb


@pytest.fixture(scope="module")
def tight(sb):
    with Sandbox(TIGHT, backend=sb.backend_name, concurrency=1) as box:
        yield box
