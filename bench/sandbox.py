"""Sandbox benchmark: latency and throughput of one 5-assert test snippet, four ways.

    python -m bench.sandbox [--rounds 5] [--samples 20] [--wave 60]

Modes, measured interleaved (round-robin, several rounds) in one run so that host load hits
them alike: `ratchet` (the "auto" backend, the zygote where the host allows), `bwrap`
(ratchet's bwrap backend), `bare` (a plain `python3 -I -S -c SNIPPET` subprocess, no
isolation), `fork_floor` (fork + _exit + wait of this process: the floor for any per-run
process). p50/p95 are single-run latencies (one at a time); runs_per_s is a wave run by two
concurrent workers; ratio_to_bare = p50 / bare's p50. Prints ONE JSON object. Default run
~30-60 s on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from ratchet.sandbox import Limits, Payload, Sandbox
from ratchet.sandbox import host
from ratchet.sandbox.pool import available_backends

SNIPPET = """\
def add(a, b):
    return a + b
assert add(1, 2) == 3
assert add(-1, 1) == 0
assert add(0, 0) == 0
assert add(2, 3) == 5
assert add(10, -4) == 6
"""


def _bare_once(python: str) -> None:
    r = subprocess.run([python, "-I", "-S", "-c", SNIPPET], stdin=subprocess.DEVNULL,
                       capture_output=True, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr


def _fork_once() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--samples", type=int, default=20, help="latency samples per mode per round")
    ap.add_argument("--wave", type=int, default=60, help="payloads per throughput wave per mode per round")
    args = ap.parse_args()

    avail = available_backends()
    payload = Payload(code=SNIPPET)
    sandboxes: dict[str, Sandbox] = {"ratchet": Sandbox(Limits(), backend="auto", concurrency=2)}
    if avail.get("bwrap") is None:
        sandboxes["bwrap"] = Sandbox(Limits(), backend="bwrap", concurrency=2)
    python = host.host_python()
    pool = ThreadPoolExecutor(2)

    def once(mode: str):
        if mode in sandboxes:
            r = sandboxes[mode].run(payload)
            assert r.ok, r
        elif mode == "bare":
            _bare_once(python)
        else:
            _fork_once()

    modes = [*sandboxes, "bare", "fork_floor"]
    lat = {m: [] for m in modes}
    thr = {m: [] for m in modes}
    for m in modes:                       # warm-up: zygotes started, caches hot
        for _ in range(5):
            once(m)
        list(pool.map(lambda _i, m=m: once(m), range(4)))
    t_start = time.monotonic()
    for _round in range(args.rounds):
        for m in modes:
            for _ in range(args.samples):
                t = time.perf_counter()
                once(m)
                lat[m].append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            if m in sandboxes:
                rs = sandboxes[m].run_many([payload] * args.wave)
                assert all(r.ok for r in rs)
            else:
                list(pool.map(lambda _i, m=m: once(m), range(args.wave)))
            thr[m].append(args.wave / (time.perf_counter() - t))
    elapsed = time.monotonic() - t_start
    for sb in sandboxes.values():
        sb.close()
    pool.shutdown()

    bare_p50 = statistics.median(lat["bare"])
    out = {
        "snippet": "5-assert test snippet",
        "modes": {m: {"p50_ms": round(statistics.median(lat[m]), 3), "p95_ms": round(_pct(lat[m], 0.95), 3),
                      "runs_per_s": round(statistics.median(thr[m]), 1),
                      "ratio_to_bare": round(statistics.median(lat[m]) / bare_p50, 3), "n": len(lat[m])}
                  for m in modes},
        "backend": sandboxes["ratchet"].backend_name,
        "targets": {"p50_ms": 3.0, "runs_per_s": 300},
        "host": {"cpus": os.cpu_count(), "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
                 "kernel": os.uname().release, "python": python},
        "measure_s": round(elapsed, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
