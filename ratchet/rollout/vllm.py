"""The vLLM rollout engine: a vLLM OpenAI server in its own virtual environment, reached over HTTP.

    server = ServerProcess(lambda port: vllm_command("/opt/vllm/bin/python", "runs/r/sync/v000000", port))
    url = server.start()                                   # waits for GET /health; stop() ends its process group
                                                           # (a port taken before the server bound it: another)
    engine = VLLMEngine(url, sync="reload")                # HTTPEngine (client.py) + vLLM's weight sync
    engine.set_policy_version(3, path="runs/r/sync/v000003")
    engine = vllm_engine("/opt/vllm/bin/python", "runs/r/sync/v000000")   # all of the above, one server per process

vLLM pins torch, transformers and fastapi versions that conflict with Prefect's (shared notes,
stack.md), so it is never imported here: ratchet starts `<vllm_python> -m vllm.entrypoints.cli.main
serve` (what the `vllm` console script runs) as a separate process in its own session, or is
given the URL of one already running (`rollout.engine_url`). The client is `HTTPEngine`, the same
one CI tests against `ratchet serve`.

Server flags ratchet sets: `--enable-prefix-caching` (a GRPO group's n samples share their prompt's
KV blocks; on by default in vLLM V1, set explicitly), `--logprobs-mode processed_logprobs` (the
log-probs of the distribution actually sampled, logits / temperature: the behaviour log-probs the
trainer's importance weights need; vLLM's default is the raw logits'), `--served-model-name`, `--seed`,
`--dtype`, and the `rollout.vllm_args` given (e.g. `--gpu-memory-utilization 0.4` when the trainer
shares the GPU). The environment gets `VLLM_SERVER_DEV_MODE=1`, which exposes the endpoints below.

Weight sync after each policy update (`rollout.vllm_sync`), from a directory the trainer wrote
(safetensors, Hugging Face layout; ratchet/rollout/behaviour.py `ServerWeights`):
- `reload` (default): `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`
  reloads the weights in place on every worker (same architecture; no re-initialisation, no
  re-capture of CUDA graphs), then `POST /reset_prefix_cache` drops the KV blocks computed with the
  old weights (a cached prefix from version v must not serve version v+1). Dev-mode endpoints.
- `restart`: stop the server and start it again on DIR (works on any vLLM version, costs a full
  start: tens of seconds to minutes); needs a server ratchet started.
vLLM's NCCL/IPC weight-transfer API (`/init_weight_transfer_engine`, `/update_weights`) would skip the
disk, but needs vLLM's own client code in the trainer process, which cannot import vLLM.
Each sync is timed by the caller (Behaviour.last_sync_s, logged by the rollout task).
A server ratchet started that has died fails the request with its exit code and the tail of its log,
not a bare "Connection refused"; transient with `restart` sync only (the retry's sync starts it again).

Not run here (no GPU in CI): `bench/gpu_check.py` checks start + generate + weight sync on a GPU
machine; tests/rollout/test_vllm.py holds the CPU-testable parts (the command line, the process
lifecycle with `ratchet serve` standing in as the same protocol) and the GPU test.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Sequence

from ratchet.errors import TransientError
from ratchet.net import free_port
from ratchet.rollout.client import HTTPEngine


def vllm_command(python: str, model: str, port: int, host: str = "127.0.0.1", served_name: str = "policy",
                 seed: int = 0, dtype: str = "auto", extra_args: Sequence[str] = ()) -> list[str]:
    """The command line that starts vLLM's OpenAI server from its own environment's `python`."""
    return [str(python), "-m", "vllm.entrypoints.cli.main", "serve", str(model),
            "--host", host, "--port", str(port), "--served-model-name", served_name,
            "--seed", str(seed), "--dtype", dtype,
            "--enable-prefix-caching", "--logprobs-mode", "processed_logprobs", *extra_args]


Command = Sequence[str] | Callable[[int], Sequence[str]]
"""A server's command line, or a function of the port it is to listen on that gives one."""

BIND_RETRIES = 3


class ServerProcess:
    """An engine server as a child process in its own session: started, polled for readiness at
    `health_path`, stopped with its whole process group. Output goes to `log_path` (its tail is in
    the error when the server dies or does not come up).

    Ready means: `health_path` answers 200 and the listener on the port is a socket of the server's
    process group (`_listens`), not another process that took the port first (free_port's window)
    and answers there too. `command` may be a function of the port (`port` None: a free one,
    `ratchet.net.free_port`); then a server whose port was taken ("address already in use" in its
    log, or another process answering) is started again on another free port, up to BIND_RETRIES
    times; `port` and `url` say where it listens."""

    def __init__(self, command: Command, port: int | None = None, host: str = "127.0.0.1", env: dict | None = None,
                 health_path: str = "/health", startup_timeout_s: float = 900.0, log_path: str | None = None):
        if port is None and not callable(command):
            raise ValueError("ServerProcess: give the port, or the command as a function of the port")
        self.port, self.host = free_port(host) if port is None else port, host
        self._use(command)
        self.env = {**os.environ, **(env or {})}
        self.health_path, self.startup_timeout_s = health_path, startup_timeout_s
        self.log_path = Path(log_path or tempfile.mkstemp(prefix=f"ratchet-engine-{os.getpid()}-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.start_s = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _use(self, command: Command) -> None:
        self.make_command = command if callable(command) else None
        self.command = list(command(self.port) if callable(command) else command)

    def start(self) -> str:
        """Start the server and wait until it answers `health_path`; returns its URL."""
        if self.proc is not None and self.proc.poll() is None:
            return self.url
        t0 = time.perf_counter()
        retries = 0
        while True:
            try:
                return self._start(t0)
            except _PortTaken:
                retries += 1
                if self.make_command is None or retries > BIND_RETRIES:
                    raise
                self.port = free_port(self.host)
                self._use(self.make_command)

    def _start(self, t0: float) -> str:
        logged = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        atexit.register(self.stop)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:   # another process: its readiness can only be polled
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=5) as resp:
                    answered = resp.status == 200
            except (OSError, urllib.error.URLError):
                answered = False
            if answered and _listens(self.proc.pid, self.port) is not False:
                break
            if answered:                 # another process took the port first and answers on it
                self.stop()
                raise _PortTaken(f"another process answers {self.url}{self.health_path}, not the engine server "
                                 f"started there ({' '.join(self.command[:6])} ...; log {self.log_path})")
            if self.proc.poll() is not None:
                taken = "address already in use" in self._log_since(logged).lower()
                raise (_PortTaken if taken else RuntimeError)(
                    f"engine server exited with code {self.proc.returncode} before it was ready: "
                    f"{' '.join(self.command[:6])} ... (log {self.log_path}: {self.log_tail()})")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"engine server not ready after {self.startup_timeout_s:.0f} s at "
                                   f"{self.url}{self.health_path} (log {self.log_path}: {self.log_tail()})")
            time.sleep(0.5)
        self.start_s = time.perf_counter() - t0
        return self.url

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after `timeout_s`."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass

    def restart(self, command: Command) -> str:
        self.stop()
        self._use(command)
        return self.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def why_down(self) -> str:
        """Why a server that is not alive() is down: its exit code and the tail of its log."""
        how = f"exited with code {self.proc.returncode}" if self.proc is not None else "was stopped"
        return f"the engine server ratchet started {how} (log {self.log_path}: {self.log_tail()})"

    def log_tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:].strip().replace("\n", " | ")
        except OSError:
            return "(no log)"

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""


class _PortTaken(RuntimeError):
    """The server could not have its port: another process held it first."""


def _listens(pgid: int, port: int) -> bool | None:
    """Whether the sockets listening on TCP `port` are all the open files of processes of group `pgid`
    (Linux's /proc/net/tcp and tcp6): False when another process listens there too (it took the port
    first, or shares it through SO_REUSEPORT, and would answer some of the requests); None where /proc
    shows no listener on it (it cannot tell)."""
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:   # sl local_address rem_address st ... inode
            f = row.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                sockets.add(f"socket:[{f[9]}]")
    if not sockets:
        return None
    ours = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:          # gone, or not ours to read
            continue
        for fd in fds:
            try:
                ours.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:      # closed meanwhile
                pass
    return sockets <= ours


class VLLMEngine(HTTPEngine):
    """HTTPEngine for a vLLM server, whose weight sync is vLLM's (module docstring), not /v1/load."""

    tracks_version = False   # vLLM's sync tells the server no version number (and vLLM answers none)

    def __init__(self, base_url: str, model: str = "policy", sync: str = "reload",
                 server: ServerProcess | None = None, restart_command=None, **kw):
        if sync not in ("reload", "restart"):
            raise ValueError(f"vllm sync: {sync!r} is not one of 'reload', 'restart'")
        if sync == "restart" and (server is None or restart_command is None):
            raise ValueError("vllm sync 'restart' needs a server ratchet started (rollout.vllm_python), "
                             "not one reached at rollout.engine_url")
        super().__init__(base_url, model=model, **kw)
        self.sync, self.server, self.restart_command = sync, server, restart_command

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        try:
            return super()._request(method, path, body)
        except OSError as e:   # refused, reset, timed out: a server ratchet started may have died
            if self.server is None or self.server.alive():
                raise
            # restart sync: the retry's re-sync starts it again; reload: it would fail the same way
            down = TransientError if self.sync == "restart" else RuntimeError
            raise down(f"{method} {self.base_url}{path}: {e}; {self.server.why_down()}") from e

    def set_policy_version(self, version: int, path: str | None = None) -> None:
        if path is None:
            raise ValueError("VLLMEngine.set_policy_version: give the directory of the version's weights")
        if self.sync == "reload":
            self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
            self._post("/reset_prefix_cache", {})
        else:
            self.base_url = self.server.restart(self.restart_command(path))   # on another port, if its was taken
        self.policy_version = version


_RUNNING: dict[tuple, VLLMEngine] = {}   # one server per settings per process, kept across session restores


def vllm_engine(python: str, model: str, extra_args: Sequence[str] = (), sync: str = "reload", seed: int = 0,
                dtype: str = "auto", startup_timeout_s: float = 900.0,
                encode: Callable[[list[str]], list[list[int]]] | None = None, timeout_s: float = 600.0) -> VLLMEngine:
    """vLLM from `python`'s environment serving `model` (a checkpoint directory): started here (stopped
    at exit), or the one this process already started with these settings, moved to `model`'s weights.
    `encode`: how prompts become the token ids sent (HTTPEngine; the caller's, also on a running one);
    `timeout_s`: how long one request may take (the same)."""
    key = (str(python), tuple(extra_args), sync, seed, dtype)
    running = _RUNNING.get(key)
    if running is not None and running.server.alive():
        running.set_policy_version(running.policy_version, path=model)
        running.encode, running.timeout_s = encode, timeout_s
        return running
    if not Path(python).exists():
        raise FileNotFoundError(f"rollout.vllm_python: {python} does not exist (the python of vLLM's own venv)")
    def command(path: str) -> Callable[[int], list[str]]:
        return lambda port: vllm_command(python, path, port, seed=seed, dtype=dtype, extra_args=extra_args)

    server = ServerProcess(command(model), env={"VLLM_SERVER_DEV_MODE": "1"}, startup_timeout_s=startup_timeout_s)
    server.start()
    _RUNNING[key] = engine = VLLMEngine(server.url, sync=sync, server=server, restart_command=command, encode=encode,
                                             timeout_s=timeout_s)
    return engine
