"""ratchet.sandbox: isolated, millisecond-fast execution of model-written code.

    from ratchet.sandbox import Limits, Payload, Sandbox, run_many
    with Sandbox(Limits(wall_s=5, memory_mb=512), concurrency=2) as sb:
        results = sb.run_many([Payload(code=src, readonly_files={"tests/test_x.py": hidden})])
    ratchet sandbox run solution.py --timeout 2 --json        # CLI
    ratchet sandbox doctor                                    # what this host offers
    python -m bench.sandbox                                   # latency / throughput

Backends ("auto" takes the first available): `zygote` (fast default, root + user namespaces),
`bwrap` (the well-known reference, one bubblewrap per run), `subprocess` (plain fallback).
`python=`/`site=`/`argv=` payloads (pytest in a venv) work on all three; on the zygote they
take the same fresh namespaces and then exec that interpreter (the zygote restarts once per
new interpreter to bind its prefix read-only). `program=` payloads exec any program, e.g.
`("/bin/sh", "-c", "make test | tail -3")` (what a task's run_command becomes), with `env=` on top
of the minimal environment; the workdir is also `/app` (zygote, bwrap). `doctor()` / `Sandbox.mechanisms` say which
mechanism enforces each limit on this host. A failure of the sandbox itself comes back as
`RunResult.infra_error` (never as a payload failure), so rewards never score it.

Threat model: the payload is hostile Python from a model being trained, which may try to
escape, cheat the verifier, or starve the worker.

Covered (zygote and bwrap backends):
- Filesystem: fresh mount namespace per run; a minimal root (pivot_root; /usr, the
  interpreter prefixes, a tiny /etc and /dev) mounted read-only; the only writable place is a
  fresh tmpfs /tmp with the workdir /tmp/work (zygote: one tmpfs, capped at 4x fsize; bwrap: an
  unsized tmpfs, the workdir a host temp directory bound in) that dies with the run. Host
  secrets, the project tree, other runs' files are not in the tree at all. Read-only payload
  files are 0444 in sticky 1777 dirs, both owned by a uid that is not the payload's (root on
  zygote; the slot uid on bwrap, whose payload is root outside its namespace), and on bwrap
  also read-only bind mounts: the payload may add files but cannot modify, remove, rename or
  replace a read-only file or a dir that holds one.
- Network: fresh, empty net namespace: no interface up, no DNS, no loopback to the host.
- Processes: fresh pid namespace; the run is pid 1 (zygote) or under bwrap's init; killing it
  kills every process the run made, daemons included; the caller and worker are invisible
  (cannot be signalled or ptraced). Fresh ipc and uts namespaces.
- Privilege: zygote runs drop to a per-slot unprivileged uid (so RLIMIT_NPROC binds), then
  enter a fresh user namespace and drop every capability, with no_new_privs. The mount, net,
  pid, ipc, uts namespaces are owned by the host's user namespace, so the payload cannot
  mount, unmount or reconfigure anything in them.
- Limits: CPU (RLIMIT_CPU), wall (timer + kill of the pid-namespace init), memory (RLIMIT_AS,
  plus a per-slot memory cgroup v1 where writable), processes (per-slot pids cgroup v1 where
  writable, plus RLIMIT_NPROC on the slot uid), file size, open files, output (capped pipes,
  `truncated`). Environment: minimal and explicit; the worker is started with a clean env.
- Nothing shared between runs: the zygote never reads a payload (each pre-warmed child reads
  its own request), output goes straight from the run's pipes to the caller, one forked child
  serves exactly one run, and each run's namespaces and tmpfs die with it.
- Cheating the verifier: `harness.call_harness` serialises return values to plain data inside
  the sandbox; comparison happens outside (an `__eq__` that always returns True fails).
- `security_events` (network_attempt, write_refused, signal_attempt, process_spawn,
  native_code, fork_limit, memory_limit, daemon_left) come from an audit hook the payload could
  tamper with (they are advisory) and from cgroup counters (fork_limit, OOM), which it cannot.

Not covered (know this before pointing it at anything that matters):
- The kernel is shared. There is no seccomp filter: every syscall reachable from an
  unprivileged user in a user namespace is reachable, so a kernel exploit escapes. This is
  the main gap; namespaces are not a security boundary against kernel bugs.
- Side channels (timing, cache, Spectre-class), CPU contention between runs, and the page
  cache are shared. Memory of the zygote (the stdlib it preloaded) is shared copy-on-write
  with every run (no payload data is ever in it).
- No /proc inside zygote runs of Python payloads; `program` runs (shell lines) get a /proc of
  their own pid namespace (as bwrap's), and their slot uid mapped to itself in their user
  namespace (unmapped, `seteuid(getuid())` fails and GNU make cannot start a recipe). No audit
  hook runs in a `program`: its security_events come from the cgroup counters only.
- The `subprocess` fallback has NO namespaces: host filesystem (as an unprivileged uid) and
  network are visible. Only for development hosts without root or user namespaces.
- Disk: only the zygote caps what a run writes in all (its tmpfs, 4x fsize). On bwrap and
  subprocess each file is capped at fsize, not their number: within its wall time a run may fill
  the host's temp dir (their workdir is there) or, on bwrap, its /tmp, a tmpfs of the kernel's
  default size (half the RAM). bubblewrap >= 0.9 could size that tmpfs (`--size`); unused here.
- bwrap runs as root here, so its payload uid maps to root outside the user namespace:
  RLIMIT_NPROC cannot bind it (the pids cgroup does); its cpu_ms comes from cpuacct.
- Security events from the audit hook can be forged or suppressed by the payload.
- Kernel keyrings: zygote runs get a fresh session keyring and user namespace each; the
  bwrap and subprocess backends share the caller's session keyring between runs.

Speed (zygote): one pre-initialised interpreter per slot, which never reads a payload. It
keeps a child pre-warmed in fresh namespaces with a fresh tmpfs (A: unshare + mount, fork B
as pid 1, exit) and hands that child's socket to the caller; the caller sends the request
and pipes straight to the child, which seeds its workdir, drops privileges, enters its user
namespace and runs the payload in the already-loaded interpreter. Per run, on the critical
path: one hand-off to the child, ~450 copy-on-write page faults in it, its exit (namespace
teardown; the mount namespace is held by the zygote and released after reporting), and one
message back. Measured with `python -m bench.sandbox` on this 2-core VM while other jobs
loaded it (load average ~9): ratchet p50 5.2 ms / p95 13.3 ms / 246 runs/s (two workers);
bare `python3 -I -S` 12.1 ms (ratio 0.43); ratchet's bwrap backend 72 ms; fork+exit of the
bench process 1.4 ms. The issue's targets (p50 <= 3 ms, >= 300 runs/s) were not shown on
this shared host; ~310 runs/s was seen once at load ~3.5. The floor is the copy-on-write
cost of a forked Python (~450 page faults a run) plus namespace creation and teardown (a
fresh net namespace alone ~0.3 ms), all of it CPU that other jobs on the same cores delay.

Production: run sandbox workers on Kubernetes under a gVisor (runsc) or Kata/Firecracker
RuntimeClass, so a kernel exploit meets a user-space kernel or a microVM first, with this
sandbox still inside for per-run limits and isolation: deploy/k8s/sandbox-runtimeclass.yaml.
"""
from __future__ import annotations

from .model import Limits, Payload, RunResult
from .pool import Sandbox, available_backends, run_many

__all__ = ["Limits", "Payload", "RunResult", "Sandbox", "run_many", "doctor"]


def doctor() -> dict:
    """What this host offers and which mechanism each limit uses with the "auto" backend."""
    import os
    from . import host
    avail = available_backends()
    with Sandbox(Limits(), backend="auto", concurrency=1) as sb:
        chosen, mechanisms, summary = sb.backend_name, dict(sb.mechanisms), sb.describe()
    return {
        "backend": chosen,
        "summary": summary,
        "backends": {n: (why or "available") for n, why in avail.items()},
        "mechanisms": mechanisms,
        "host": {
            "euid": os.geteuid(), "kernel": os.uname().release, "python": host.host_python(),
            "user_namespaces": host.userns(), "cgroups": host.cgroups(), "bwrap": host.bwrap(),
        },
    }
