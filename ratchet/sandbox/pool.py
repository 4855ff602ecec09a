"""The Sandbox: a backend, `concurrency` slots, and the wave API (N payloads in, N results
out, in input order). A crash inside the sandbox machinery becomes an infra_error result,
never an exception, so one bad run cannot sink a wave."""
from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from . import backends, lease
from .model import Limits, Payload, RunResult

AUTO_ORDER = ("zygote", "bwrap", "subprocess")
log = logging.getLogger("ratchet.sandbox")


def available_backends() -> dict[str, str | None]:
    """{name: None if usable here, else the reason it is not}."""
    backends.load_all()
    return {name: backends.AVAILABLE[name]() for name in AUTO_ORDER if name in backends.AVAILABLE}


class Sandbox:
    """Runs payloads in isolation. Use as a context manager, or call close()."""

    def __init__(self, limits: Limits = Limits(), backend: str = "auto", concurrency: int = 2):
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.limits, self.concurrency = limits, concurrency
        avail = available_backends()
        self._free: queue.LifoQueue = queue.LifoQueue()
        self._made = 0
        if backend == "auto":
            # Start the first slot now: a backend that looks available but cannot start on
            # this host (e.g. no pivot_root in some container) falls through to the next one.
            skipped = []
            for name, why in avail.items():
                if why is not None:
                    continue
                try:
                    impl = backends.BACKENDS[name](limits)
                    self._free.put(impl.new_slot())
                    self._made = 1
                    break
                except Exception as e:
                    skipped.append(f"{name}: {type(e).__name__}: {e}")
            else:
                raise RuntimeError("no sandbox backend could start: " + "; ".join(skipped))
            backend = name
        elif backend not in avail:
            raise ValueError(f"unknown sandbox backend {backend!r}; known: {sorted(avail)}")
        elif avail[backend] is not None:
            raise RuntimeError(f"sandbox backend {backend!r} is not available here: {avail[backend]}")
        else:
            impl = backends.BACKENDS[backend](limits)
            skipped = []
        self.backend_name = backend
        self._backend = impl
        self.mechanisms: dict[str, str] = {"backend": backend, **self._backend.mechanisms}
        if skipped:
            self.mechanisms["skipped"] = "; ".join(skipped)
        log.info("sandbox: %s", self.describe())
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        lease.start_reaper()   # runs of this host's dead or stuck workers end here (ratchet/sandbox/lease.py)

    def describe(self) -> str:
        """One line: the backend and which mechanism each limit uses on this host."""
        keys = ("cpu", "wall", "memory", "pids", "fsize", "nofile", "output")
        return f"backend={self.backend_name}; " + "; ".join(f"{k}={self.mechanisms[k]}" for k in keys
                                                          if k in self.mechanisms)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _slot(self):
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._made < self.concurrency:
                self._made += 1
                try:
                    return self._backend.new_slot()
                except BaseException:
                    self._made -= 1
                    raise
        return self._free.get()

    def run(self, payload: Payload) -> RunResult:
        if self._closed:
            raise RuntimeError("Sandbox is closed")
        t0 = time.monotonic()
        try:
            slot = self._slot()
        except Exception as e:
            return RunResult.infra(f"sandbox slot could not start: {type(e).__name__}: {e}")
        try:
            return slot.run(payload)
        except Exception as e:
            # The slot's machinery failed: drop it (a new one is made on demand).
            with self._lock:
                self._made -= 1
            try:
                slot.close()
            except Exception:
                pass
            slot = None
            tb = traceback.format_exc(limit=3)
            return RunResult.infra(f"sandbox failed: {type(e).__name__}: {e}\n{tb}",
                                   wall_ms=(time.monotonic() - t0) * 1000)
        finally:
            if slot is not None:
                self._free.put(slot)

    def run_many(self, payloads: Sequence[Payload]) -> list[RunResult]:
        payloads = list(payloads)
        lease.reap()
        if len(payloads) <= 1 or self.concurrency == 1:
            return [self.run(p) for p in payloads]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="sandbox")
        return list(self._pool.map(self.run, payloads))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        while True:
            try:
                self._free.get_nowait().close()
            except queue.Empty:
                break
            except Exception:
                pass
        self._backend.close()


_defaults: dict[tuple, Sandbox] = {}
_default_lock = threading.Lock()


def run_many(payloads: Sequence[Payload], limits: Limits | None = None,
             concurrency: int | None = None) -> list[RunResult]:
    """Run a wave on a process-wide default Sandbox (one per (limits, concurrency), created
    lazily, closed at exit)."""
    key = (limits or Limits(), concurrency or 2)
    with _default_lock:
        sb = _defaults.get(key)
        if sb is None:
            sb = _defaults[key] = Sandbox(key[0], concurrency=key[1])
    return sb.run_many(payloads)


@atexit.register
def close_defaults() -> None:
    """Stop the default Sandboxes' workers (also at interpreter exit)."""
    for sb in list(_defaults.values()):
        sb.close()
    _defaults.clear()
