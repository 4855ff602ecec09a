"""The vLLM engine's parts that run without a GPU, and the one that needs it.

CPU: the server command line; the server process lifecycle (start, readiness, weight sync through
a directory, restart on a new checkpoint, stop of the whole process group) with `ratchet serve`
standing in, as a real child process speaking the same protocol (OpenAI completions + a checkpoint
directory to load); a server that dies at start. GPU (marked, skipped here): vLLM itself, started
from its own environment (RATCHET_VLLM_PYTHON), generating and taking a weight reload.

    .venv/bin/python -m pytest tests/rollout/test_vllm.py -q
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from ratchet.model import load_policy
from ratchet.rollout.behaviour import ServerWeights
from ratchet.rollout.client import HTTPEngine
from ratchet.rollout.torch_engine import TorchEngine
from ratchet.net import free_port
from ratchet.rollout.vllm import ServerProcess, VLLMEngine, _listens, vllm_command, vllm_engine
from tests.rollout.test_engine_contract import PROMPTS

ROOT = Path(__file__).resolve().parents[2]


def ratchet_serve(model, port: int) -> list[str]:
    return [sys.executable, "-m", "ratchet.cli", "serve", "--model", str(model), "--port", str(port), "--name", "policy"]


def greedy_logprobs(engine, n_tokens: int = 6) -> list[list[float]]:
    return [r.logprobs for r in engine.generate(PROMPTS, n=1, max_new_tokens=n_tokens, greedy=True)]


def test_the_vllm_command_line():
    cmd = vllm_command("/opt/vllm/bin/python", "/ckpt/v000003", 8123, seed=7, extra_args=["--gpu-memory-utilization", "0.4"])
    assert cmd[:5] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.cli.main", "serve", "/ckpt/v000003"]
    flags = " ".join(cmd[5:])
    for part in ("--host 127.0.0.1", "--port 8123", "--served-model-name policy", "--seed 7", "--enable-prefix-caching",
                 "--logprobs-mode processed_logprobs", "--gpu-memory-utilization 0.4"):
        assert part in flags
    with pytest.raises(FileNotFoundError, match="rollout.vllm_python: /no/such/python does not exist"):
        vllm_engine("/no/such/python", "/ckpt")
    with pytest.raises(ValueError, match="'restart' needs a server ratchet started"):
        VLLMEngine("http://127.0.0.1:1", sync="restart")


def test_a_server_that_dies_at_start_is_reported_with_its_log(tmp_path):
    server = ServerProcess([sys.executable, "-c", "import sys; print('no GPU found'); sys.exit(3)"], free_port(),
                           log_path=str(tmp_path / "engine.log"))
    with pytest.raises(RuntimeError, match=r"exited with code 3 before it was ready.*no GPU found"):
        server.start()
    assert not server.alive()


DIES_AFTER_ONE_REQUEST = """
import http.server, sys
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ok).handle_request()   # the health check
print("RuntimeError: CUDA error: an illegal memory access was encountered", flush=True)
sys.exit(1)
"""


def test_a_server_that_died_is_reported_with_its_exit_code_and_log(tmp_path):
    """Found by review: a vLLM server ratchet started that died surfaced as "Connection refused" (after
    the task's retries), its log never read. The engine's error now says it exited, with the log's tail;
    not transient with reload sync (nothing would start it again), transient with restart sync (the
    retry's re-sync starts it)."""
    from ratchet.errors import is_transient

    server = ServerProcess(lambda port: [sys.executable, "-c", DIES_AFTER_ONE_REQUEST, str(port)], health_path="/",
                           startup_timeout_s=60, log_path=str(tmp_path / "engine.log"))
    server.start()
    server.proc.wait(timeout=60)
    for sync, transient in (("reload", False), ("restart", True)):
        engine = VLLMEngine(server.url, sync=sync, server=server, restart_command=lambda p: ["true"])
        with pytest.raises(Exception, match=r"Connection refused.*engine server ratchet started exited with code 1 "
                                            r"\(log .*engine.log: .*an illegal memory access was encountered") as e:
            engine.generate(PROMPTS, max_new_tokens=2)
        assert is_transient(e.value) is transient
    with pytest.raises(OSError, match="Connection refused"):       # not one ratchet started: as it was
        VLLMEngine(server.url).generate(PROMPTS, max_new_tokens=2)


def test_a_server_whose_port_was_taken_first_starts_again_on_another(tmp_path):
    """free_port's window: another process binds the port before the server does. Given its command as
    a function of the port, ServerProcess starts it again on a free one; given a fixed command line,
    it reports the exit with the log that says why. Where the taker answers the health check itself,
    its 200 is not taken for this server's: the port's listener must be of this server's process group."""
    def http_server(port: int) -> list[str]:
        return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = ServerProcess(http_server, port, health_path="/", startup_timeout_s=60,
                               log_path=str(tmp_path / "moved.log"))
        try:
            assert server.start() == f"http://127.0.0.1:{server.port}" and server.port != port
            assert "address already in use" in (tmp_path / "moved.log").read_text().lower()   # the first try's
            assert server.alive()
        finally:
            server.stop()
        fixed = ServerProcess(http_server(port), port, health_path="/", log_path=str(tmp_path / "fixed.log"))
        with pytest.raises(RuntimeError, match="(?i)before it was ready.*address already in use"):
            fixed.start()
    # the port's taker is a server that answers too: its 200 is not this server being ready
    other = ServerProcess(http_server, health_path="/", startup_timeout_s=60, log_path=str(tmp_path / "other.log"))
    try:
        other.start()
        assert _listens(other.proc.pid, other.port) is True
        moved = ServerProcess(http_server, other.port, health_path="/", startup_timeout_s=60,
                              log_path=str(tmp_path / "moved-again.log"))
        try:
            moved.start()
            assert moved.port != other.port and _listens(moved.proc.pid, moved.port) is True
        finally:
            moved.stop()
        with pytest.raises(RuntimeError, match="another process answers http://127.0.0.1:.*/, not the engine server"):
            ServerProcess(http_server(other.port), other.port, health_path="/", startup_timeout_s=60,
                          log_path=str(tmp_path / "fixed-again.log")).start()
        assert _listens(os.getpid(), other.port) is False
    finally:
        other.stop()
    with pytest.raises(ValueError, match="give the port, or the command as a function of the port"):
        ServerProcess(["serve"])


@pytest.mark.slow   # two server processes start (torch + transformers imports): ~25 s of CPU, ~60 s on a busy machine
def test_server_lifecycle_and_weight_sync_through_a_directory(checkpoints, tmp_path):
    """A `ratchet serve` child process gets version 0's weights, then version 1's, through sync_dir
    (POST /v1/load), then is restarted on a checkpoint (vLLM's `restart` sync); each time its greedy
    log-probs are those of the in-process engine on the same weights. stop() ends the process."""
    a, b = (load_policy(p) for p in checkpoints)
    local = {0: TorchEngine(a[0].eval(), a[1]), 1: TorchEngine(b[0].eval(), b[1])}
    port = free_port()
    server = ServerProcess(ratchet_serve(checkpoints[0], port), port, env={"PYTHONPATH": str(ROOT)},
                           startup_timeout_s=240, log_path=str(tmp_path / "serve.log"))
    try:
        url = server.start()
        behaviour = ServerWeights(HTTPEngine(url, model="policy"), tmp_path / "sync", keep=1)
        for version, (model, tok) in enumerate((a, b)):
            behaviour.publish(version, model, tok)
            with behaviour.at(version) as engine:
                got = greedy_logprobs(engine)
            assert engine.models()[0]["policy_version"] == version
            assert engine.models()[0]["root"] == str(behaviour.sync_dir / f"v{version:06d}")
            for g, want in zip(got, greedy_logprobs(local[version])):
                assert torch.allclose(torch.tensor(g), torch.tensor(want), atol=1e-4)
        assert behaviour.sync_dir.parent == tmp_path / "sync"                       # this run's own directory
        assert sorted(p.name for p in behaviour.sync_dir.iterdir()) == ["v000001"]   # keep=1: v0 removed
        assert behaviour.last_sync_s > 0

        restart = VLLMEngine(url, sync="restart", server=server, restart_command=lambda p: ratchet_serve(p, port))
        restart.set_policy_version(7, path=str(checkpoints[0]))       # a new server process on checkpoint a
        assert restart.policy_version == 7 and server.alive()
        for g, want in zip(greedy_logprobs(restart), greedy_logprobs(local[0])):
            assert torch.allclose(torch.tensor(g), torch.tensor(want), atol=1e-4)
        pid = server.proc.pid
    finally:
        server.stop()
    assert not server.alive()
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)                                            # the whole process group is gone


@pytest.mark.gpu
def test_vllm_generates_and_takes_a_weight_reload(checkpoints, tmp_path):
    """vLLM from its own environment (RATCHET_VLLM_PYTHON), on checkpoint a, then reloaded in place
    with checkpoint b: its greedy log-probs follow the in-process engine's on b. See bench/gpu_check.py."""
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a CUDA GPU")
    python = os.environ.get("RATCHET_VLLM_PYTHON")
    if not python:
        pytest.skip("set RATCHET_VLLM_PYTHON to the python of vLLM's own environment")
    engine = vllm_engine(python, str(checkpoints[0]), ["--dtype", "float32", "--max-model-len", "64"])
    try:
        b = load_policy(checkpoints[1])
        engine.set_policy_version(1, path=str(checkpoints[1]))
        got = engine.generate(PROMPTS, n=1, max_new_tokens=6, greedy=True)
        want = TorchEngine(b[0].eval(), b[1]).generate(PROMPTS, n=1, max_new_tokens=6, greedy=True)
        for g, w in zip(got, want):
            if g.completion_ids == w.completion_ids:
                assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-2)
    finally:
        engine.server.stop()
