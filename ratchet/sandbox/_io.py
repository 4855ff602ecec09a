"""Caller-side plumbing shared by the backends: pipes in, capped output out, deadlines.

Output never passes through a long-lived process that later runs another payload: it goes
straight from the run's pipes into the caller, so no run can find another run's output in
a worker's memory."""
from __future__ import annotations

import os
import select
import signal as _signal
import time
from dataclasses import dataclass, field

from .model import Limits, RunResult


@dataclass
class Collected:
    out: bytearray = field(default_factory=bytearray)
    err: bytearray = field(default_factory=bytearray)
    events: list[str] = field(default_factory=list)
    truncated: bool = False
    killed_by: str | None = None   # "wall" | "output" set by the collector itself


class Pump:
    """Feeds stdin, reads stdout/stderr/events with a cap, until `done_fd` is readable.

    kill(reason) is called once when the wall deadline passes or output overflows."""

    def __init__(self, out_fd: int, err_fd: int, ev_fd: int | None, stdin_fd: int | None,
                 stdin: bytes, cap: int, deadline: float, kill):
        self.c = Collected()
        self.cap, self.deadline, self.kill = cap, deadline, kill
        self.bufs = {out_fd: self.c.out, err_fd: self.c.err}
        self.ev_fd, self.evbuf = ev_fd, bytearray()
        self.open = {out_fd, err_fd} | ({ev_fd} if ev_fd is not None else set())
        self.stdin_fd, self.stdin = stdin_fd, memoryview(stdin)
        if stdin_fd is not None:
            if stdin:
                os.set_blocking(stdin_fd, False)
            else:
                os.close(stdin_fd)
                self.stdin_fd = None

    def _kill(self, reason: str) -> None:
        if self.c.killed_by is None:
            self.c.killed_by = reason
            self.kill(reason)

    def _read(self, fd: int) -> None:
        try:
            data = os.read(fd, 65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.open.discard(fd)
            os.close(fd)
            return
        if fd == self.ev_fd:
            if len(self.evbuf) < 4096:
                self.evbuf += data
            return
        buf = self.bufs[fd]
        room = self.cap - len(buf)
        if len(data) > room:
            buf += data[:max(room, 0)]
            self.c.truncated = True
            self._kill("output")
        else:
            buf += data

    def _write_stdin(self) -> None:
        try:
            n = os.write(self.stdin_fd, self.stdin[:65536])
            self.stdin = self.stdin[n:]
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.stdin = self.stdin[:0]
        if not self.stdin:
            os.close(self.stdin_fd)
            self.stdin_fd = None

    def run(self, done_fd: int, grace: float = 5.0) -> bool:
        """Pump until done_fd is readable (the run's main process has ended): True. False if
        it is still not readable `grace` seconds after the kill (the sandbox itself is stuck)."""
        poller = select.poll()
        for fd in self.open:
            poller.register(fd, select.POLLIN)
        poller.register(done_fd, select.POLLIN)
        if self.stdin_fd is not None:
            poller.register(self.stdin_fd, select.POLLOUT)
        give_up = None
        while True:
            now = time.monotonic()
            left = self.deadline - now
            if left <= 0 and self.c.killed_by is None:
                self._kill("wall")
            if self.c.killed_by is not None:
                give_up = give_up or now + grace
                if now >= give_up:
                    return False
                left = give_up - now
            for fd, ev in poller.poll(max(left, 0) * 1000 + 1):
                if fd == done_fd:
                    return True
                if fd == self.stdin_fd:
                    self._write_stdin()
                    if self.stdin_fd is None:
                        poller.unregister(fd)
                    continue
                self._read(fd)
                if fd not in self.open:
                    poller.unregister(fd)

    def read_available(self) -> None:
        """Read what is already buffered, without waiting (bounded: a writer may never stop)."""
        for _ in range(16):
            if not self.open:
                return
            r, _, _ = select.select(list(self.open), [], [], 0)
            if not r:
                return
            for fd in r:
                self._read(fd)

    def drain(self, timeout: float = 2.0) -> bool:
        """After the run ended (and everything in it was killed): read to EOF. False if stuck."""
        if self.stdin_fd is not None:
            os.close(self.stdin_fd)
            self.stdin_fd = None
        end = time.monotonic() + timeout
        while self.open:
            left = end - time.monotonic()
            if left <= 0:
                self.close()
                return False
            r, _, _ = select.select(list(self.open), [], [], left)
            for fd in r:
                self._read(fd)
        return True

    def close(self) -> None:
        for fd in list(self.open):
            os.close(fd)
        self.open.clear()
        if self.stdin_fd is not None:
            os.close(self.stdin_fd)
            self.stdin_fd = None

    def events(self) -> list[str]:
        names = self.evbuf.decode("ascii", "replace").split()
        return [n for n in dict.fromkeys(names) if n.replace("_", "").isalnum() and len(n) < 40]


def classify(limits: Limits, status: int, cpu_ms: float, collected: Collected, events: list[str],
             extra_killed: str | None = None) -> tuple[int | None, int | None, str | None]:
    """(exit_code, signal, killed_by) from a wait status and what the run hit."""
    if os.WIFSIGNALED(status):
        code, sig = None, os.WTERMSIG(status)
    else:
        code, sig = os.WEXITSTATUS(status), None
    killed = collected.killed_by or extra_killed
    if killed is None and sig is not None:
        if sig in (_signal.SIGXCPU,) or (sig == _signal.SIGKILL and cpu_ms >= limits.cpu_s * 1000 * 0.5):
            killed = "cpu"
        elif sig == _signal.SIGXFSZ:
            killed = "fsize"
    if killed is None and "memory_limit" in events:
        killed = "memory"
    return code, sig, killed


def build_result(limits: Limits, status: int, pump: Pump, wall_ms: float, cpu_ms: float,
                 peak_mb: float, events: list[str], extra_killed: str | None = None,
                 infra_error: str | None = None) -> RunResult:
    events = list(dict.fromkeys(events))
    code, sig, killed = classify(limits, status, cpu_ms, pump.c, events, extra_killed)
    if killed == "pids" and "fork_limit" not in events:
        events.append("fork_limit")
    return RunResult(exit_code=code, signal=sig, killed_by=killed, timed_out=killed == "wall",
                     stdout=pump.c.out.decode("utf-8", "replace"),
                     stderr=pump.c.err.decode("utf-8", "replace"), truncated=pump.c.truncated,
                     wall_ms=wall_ms, cpu_ms=cpu_ms, peak_memory_mb=peak_mb,
                     security_events=tuple(events), infra_error=infra_error)
