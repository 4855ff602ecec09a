"""The fast default: one zygote per slot (see ratchet/sandbox/_zygote_server.py), forking a
fresh, fully namespaced child per run. Payloads that need another interpreter or its
site-packages (`python=`, `site=True`, `argv=`) take the same path up to the last step, then
exec that interpreter inside the run's fresh namespaces (the zygote is restarted once with the
interpreter's prefix bound read-only into its root)."""
from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import time

from . import register
from ._host_run import interpreter_argv
from .. import host, lease
from .._io import Pump, build_result
from ..model import Limits, Payload, RunResult

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER = os.path.join(HERE, "_zygote_server.py")
BOOT = os.path.join(HERE, "_boot.py")
START_TIMEOUT_S = 20.0
INLINE_MAX = 65000   # requests up to this size travel in the hand-off message, larger ones by pipe


class ZygoteSlot:
    def __init__(self, limits: Limits, binds: set[str]):
        self.limits = limits
        self.binds = set(binds)
        self.uid = host.alloc_uid()
        self.cg = host.SlotCgroup(f"zygote-{os.getpid()}-{self.uid}", limits.max_procs, limits.memory_mb,
                                  extra_procs=4) if host.cgroups() else None   # zygote, idle child, warming pair
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.ready: list[tuple[int, socket.socket]] = []
        self.pidfds: dict[int, int] = {}
        self.error: str | None = None
        self.start()

    def start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cfg = {"uid": self.uid, "limits": _limits_dict(self.limits), "binds": sorted(self.binds),
               "boot": BOOT, "cgroup_procs": self.cg.procs_files() if self.cg else [], "fd": child.fileno()}
        try:
            self.proc = subprocess.Popen(
                [host.host_python(), "-I", "-S", SERVER, json.dumps(cfg)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(child.fileno(),), env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True)
        finally:
            child.close()
        self.sock = parent
        self.ready: list[tuple[int, socket.socket]] = []
        if self._next_ready(START_TIMEOUT_S) is None:
            why = self.error or "zygote exited at start"
            self.close()
            raise RuntimeError(why)

    def _handle(self, timeout: float | None = None) -> dict | None:
        """Receive one message from the zygote; None if it is gone (or silent past timeout)."""
        self.sock.settimeout(timeout)
        try:
            data, fds, _f, _a = socket.recv_fds(self.sock, 65536, 1)
        except (OSError, socket.timeout):
            return None
        finally:
            self.sock.settimeout(None)
        if not data:
            return None
        msg = json.loads(data)
        if msg["op"] == "ready" and fds:
            self.ready.append((msg["pid"], socket.socket(fileno=fds[0])))
            try:   # our own handle on the child: if the zygote dies, we still end its run
                self.pidfds[msg["pid"]] = os.pidfd_open(msg["pid"])
            except OSError:
                pass
        elif msg["op"] == "error":
            self.error = msg.get("msg")
        elif msg["op"] == "exit":
            for i, (pid, s) in enumerate(self.ready):   # a handed-out child died unused
                if pid == msg["pid"]:
                    s.close()
                    del self.ready[i]
                    break
            fd = self.pidfds.pop(msg["pid"], None)
            if fd is not None:
                os.close(fd)
        return msg

    def _next_ready(self, timeout: float) -> bool | None:
        end = time.monotonic() + timeout
        while not self.ready:
            left = end - time.monotonic()
            if left <= 0 or self._handle(left) is None:   # (a failed warm-up is retried by the zygote)
                return None
        return True

    def restart(self, binds: set[str] | None = None) -> None:
        self._stop()
        if binds:
            self.binds |= binds
        self.start()

    def run(self, payload: Payload) -> RunResult:
        t0 = time.monotonic()
        if payload.needs_exec:
            need = set(host.python_prefixes(payload.python or host.host_python()))
            if not need <= self.binds:
                self.restart(need)
        if self.proc is None or self.proc.poll() is not None:
            self.restart()
        req = {"files": [[p, base64.b64encode(d).decode(), ro] for p, d, ro in payload.all_files()],
               "code": payload.code, "exec": payload.needs_exec}
        if payload.needs_exec:
            req["argv_exec"] = interpreter_argv(payload, 3, "/tmp/work", "/tmp/.main.py")
            req["env"] = dict(payload.env)
            req["program"] = bool(payload.program) and payload.code is None and not payload.argv
        body = json.dumps(req).encode()
        inline = body if len(body) <= INLINE_MAX else b""
        self.error = None
        for _attempt in range(3):      # a pre-warmed child that died unused is skipped
            if self._next_ready(START_TIMEOUT_S) is None:
                self._stop()
                return RunResult.infra(f"sandbox worker died: {self.error or 'no child ready'}",
                                       wall_ms=(time.monotonic() - t0) * 1000)
            b, bsock = self.ready.pop(0)
            pipes = [os.pipe() for _ in range(5)]          # req, stdin, stdout, stderr, events
            (req_r, req_w), (in_r, in_w), (out_r, out_w), (err_r, err_w), (ev_r, ev_w) = pipes
            if self.cg:
                self.cg.reset_peak()
                before = self.cg.counters()
            try:
                socket.send_fds(bsock, [inline], [req_r, in_r, out_w, err_w, ev_w])
                sent = True
            except OSError:
                sent = False
            bsock.close()
            for fd in (req_r, in_r, out_w, err_w, ev_w):
                os.close(fd)
            if sent:
                break
            for fd in (req_w, in_w, out_r, err_r, ev_r):
                os.close(fd)
        else:
            return RunResult.infra("sandbox could not hand the run to a worker child",
                                   wall_ms=(time.monotonic() - t0) * 1000)
        held = lease.take(b, self.limits.wall_s, self.uid)   # B: the run's pid-namespace init, own session
        try:
            return self._finish(b, req_w, inline, body, in_w, out_r, err_r, ev_r, payload, t0,
                                before if self.cg else None)
        finally:
            held.release()

    def _finish(self, b, req_w, inline, body, in_w, out_r, err_r, ev_r, payload, t0, before) -> RunResult:
        try:
            if not inline:
                _write_all(req_w, body)
        except OSError:
            pass   # the child died before reading: its exit is reported below
        finally:
            os.close(req_w)

        def kill(_reason: str) -> None:
            try:
                self.sock.send(json.dumps({"op": "kill", "pid": b}).encode())
            except OSError:
                pass

        pump = Pump(out_r, err_r, ev_r, in_w, payload.stdin, self.limits.output_bytes,
                    t0 + self.limits.wall_s, kill)
        while True:
            if not pump.run(self.sock.fileno()):
                pump.close()
                self._stop()
                return RunResult.infra("sandbox worker did not end a killed run",
                                       wall_ms=(time.monotonic() - t0) * 1000)
            msg = self._handle()
            if msg is None:
                pump.close()
                self._stop()
                return RunResult.infra("sandbox worker died during the run",
                                       wall_ms=(time.monotonic() - t0) * 1000)
            if msg["op"] == "exit" and msg["pid"] == b:
                break
        wall_ms = (time.monotonic() - t0) * 1000
        events = []
        if not pump.drain():
            events.append("output_held_open")
        events = pump.events() + events
        extra = None
        peak = msg["maxrss"] / 1024
        if self.cg:
            after = self.cg.counters()
            if after["pids_max"] > before["pids_max"]:
                events.append("fork_limit")
            if after["oom_kill"] > before["oom_kill"]:
                extra = "memory"
        status = msg["status"]
        if extra is None and "fork_limit" in events and not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
            extra = "pids"
        return build_result(self.limits, status, pump, wall_ms, msg["cpu"] * 1000, peak, events, extra)

    def _stop(self) -> None:
        for _pid, s in self.ready:
            s.close()
        self.ready = []
        for fd in self.pidfds.values():     # children the zygote can no longer end for us
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            os.close(fd)
        self.pidfds = {}
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    self.proc.wait(timeout=2)   # it exits when the socket closes
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None

    def close(self) -> None:
        self._stop()
        if self.cg:
            self.cg.remove()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _limits_dict(limits: Limits) -> dict:
    import dataclasses
    return dataclasses.asdict(limits)


class ZygoteBackend:
    name = "zygote"

    def __init__(self, limits: Limits):
        self.limits = limits
        self.binds = set(host.python_prefixes(host.host_python()))
        cg = host.cgroups()
        self.mechanisms = {
            "isolation": "fresh user, pid, mount, net, ipc, uts namespaces per run; minimal read-only root "
                         "(pivot_root); fresh tmpfs /tmp (workdir /tmp/work); no /proc, no network",
            "uid": "per-slot unprivileged uid, no capabilities, no_new_privs",
            "cpu": "RLIMIT_CPU",
            "wall": "timer + SIGKILL of the run's pid-namespace init (tears down every process of the run)",
            "memory": "RLIMIT_AS" + (" + memory cgroup v1 (per slot)" if "memory" in cg else ""),
            "pids": ("pids cgroup v1 (per slot) + " if "pids" in cg else "") + "RLIMIT_NPROC on the slot uid",
            "fsize": "RLIMIT_FSIZE + tmpfs size (4x fsize)",
            "nofile": "RLIMIT_NOFILE", "output": "capped pipes read by the caller",
        }

    def new_slot(self) -> ZygoteSlot:
        return ZygoteSlot(self.limits, self.binds)

    def close(self) -> None:
        pass


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (to build the per-run namespaces and drop to a per-slot uid)"
    if not hasattr(os, "pidfd_open"):
        return "needs os.pidfd_open (Linux >= 5.3, Python >= 3.9)"
    if not host.userns():
        return "user namespaces are not available"
    return None


register("zygote", ZygoteBackend, _unavailable)
