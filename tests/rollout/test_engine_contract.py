"""One contract for every rollout engine (ratchet/rollout/engine.py): the in-process TorchEngine,
HTTPEngine against `ratchet serve` on loopback, and (GPU only) HTTPEngine against a vLLM server.

The model is tests/train/tiny.py's, with a tokenizer large enough to have multi-character tokens
(so a stop string can end inside a token), saved to disk as a checkpoint is.

    .venv/bin/python -m pytest tests/rollout/test_engine_contract.py -q
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import urllib.error
import urllib.request

import pytest
import torch
from typer.testing import CliRunner

from ratchet.model import build_model, build_tokenizer, load_policy, save_policy
from ratchet.net import free_port
from ratchet.rollout.client import EngineRequestError, HTTPEngine
from ratchet.rollout.engine import RolloutEngine, first_stop
from ratchet.rollout.torch_engine import TorchEngine
from tests.train import tiny
from tests.waiting import until

PROMPTS = ["# add 3, then negate it\ndef f(x):\n", "# add 7\n", "def f(x):\n    x = x + 1\n"]   # lengths differ


def _save(path, seed: int):
    tok = build_tokenizer(tiny.CORPUS, 300)                       # ~40 merges: "    ", "return", ...
    return save_policy(build_model(tiny.TINY.model_copy(update={"seed": seed}), tok), tok, path)


@pytest.fixture(scope="module")
def reference(checkpoints):
    """The in-process engine on the saved checkpoint: what every engine is held to."""
    model, tok = load_policy(checkpoints[0])
    return TorchEngine(model.eval(), tok)


class _LoopbackServer:
    """`ratchet serve`'s app in uvicorn on a thread. The socket listens before the thread starts,
    so a request sent at once waits in the backlog: no readiness polling."""

    def __init__(self, model_dir, name="tiny"):
        import uvicorn

        from ratchet.rollout.server import create_app

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(str(model_dir), name), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def server(checkpoints):
    s = _LoopbackServer(checkpoints[0])
    yield s.url
    s.stop()


@pytest.fixture(scope="module")
def vllm_server(checkpoints):
    """A vLLM server in its own environment (never imported here): RATCHET_VLLM names its `vllm`."""
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a CUDA GPU")
    exe = os.environ.get("RATCHET_VLLM") or shutil.which("vllm")
    if not exe:
        pytest.skip("no vllm executable (set RATCHET_VLLM to the `vllm` of its own environment)")
    port = free_port()
    proc = subprocess.Popen([exe, "serve", str(checkpoints[0]), "--host", "127.0.0.1", "--port", str(port),
                             "--served-model-name", "tiny", "--dtype", "float32", "--seed", "0",
                             "--logprobs-mode", "processed_logprobs"])
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:   # an external process: its readiness can only be polled
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            return True
        except OSError:
            assert proc.poll() is None, f"vllm serve exited with code {proc.returncode} before it came up"
            return False

    try:
        until(up, timeout=600, every=1, what="vllm serve's /health")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(params=["torch", "http", pytest.param("vllm", marks=pytest.mark.gpu)])
def engine(request, reference) -> RolloutEngine:
    if request.param == "torch":
        return reference
    url = request.getfixturevalue("server" if request.param == "http" else "vllm_server")
    return HTTPEngine(url)


def _full_forward_logprobs(model, r, temperature=1.0) -> torch.Tensor:
    """log p(completion token | prefix) under logits / temperature, one forward without a cache."""
    ids = torch.tensor([r.prompt_ids + r.completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1] / temperature, -1)
    return logp[len(r.prompt_ids) - 1:].gather(1, ids[0, len(r.prompt_ids):, None]).squeeze(1)


def _fields(rollouts):
    return [(r.prompt_index, r.prompt_ids, r.completion_ids, r.text, r.finished, r.stop) for r in rollouts]


# --- the contract, for every engine -------------------------------------------------------------


def test_engines_implement_the_interface(engine):
    assert isinstance(engine, RolloutEngine)


def test_greedy_output_is_identical_across_engines(engine, reference):
    out = engine.generate(PROMPTS, n=2, greedy=True, max_new_tokens=12)
    ref = reference.generate(PROMPTS, n=2, greedy=True, max_new_tokens=12)
    assert _fields(out) == _fields(ref)
    for r, q in zip(out, ref):
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(q.logprobs), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("greedy", [False, True])
def test_behaviour_logprobs_equal_a_full_forward(engine, reference, greedy):
    """Under logits / temperature when sampling; under the raw logits when greedy."""
    out = engine.generate(PROMPTS, n=3, max_new_tokens=10, temperature=0.7, greedy=greedy, seed=0)
    for r in out:
        assert len(r.completion_ids) == len(r.logprobs) > 0
        expected = _full_forward_logprobs(reference.model, r, 1.0 if greedy else 0.7)
        torch.testing.assert_close(torch.tensor(r.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_seeded_sampling_is_deterministic(engine, request):
    runs = [[r.completion_ids for r in engine.generate(PROMPTS, n=4, max_new_tokens=12, seed=s, batch_size=5)]
            for s in (5, 5, 6)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert len({tuple(c) for c in runs[0]}) > 1          # samples within a group differ
    if "vllm" not in request.node.callspec.id:           # ratchet serve runs the same engine: same draws
        reference = request.getfixturevalue("reference")
        assert runs[0] == [r.completion_ids for r in reference.generate(PROMPTS, n=4, max_new_tokens=12, seed=5,
                                                                        batch_size=5)]


def test_n_samples_are_grouped_by_prompt(engine, reference):
    out = engine.generate(PROMPTS, n=3, max_new_tokens=6, seed=1)
    assert [r.prompt_index for r in out] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    encoded = reference.encode_prompts(PROMPTS)
    assert [r.prompt_ids for r in out] == [encoded[r.prompt_index] for r in out]


def _stop_inside_a_token(tokenizer, ids):
    """A 2-character stop string that starts in token j-1 and ends inside token j (a multi-character
    token), occurring first there: (stop, j), or None."""
    for j in range(1, len(ids)):
        before, piece = tokenizer.decode(ids[:j]), tokenizer.decode([ids[j]])
        if len(piece) >= 2 and piece[0].isascii() and piece[0].isprintable() and before[-1:].isascii() \
                and before[-1:].isprintable() and before:
            stop = before[-1] + piece[0]
            if tokenizer.decode(ids).find(stop) == len(before) - 1:
                return stop, j
    return None


def test_stop_cuts_at_the_token_that_completes_it(engine, reference):
    """One sequence, seeded: with a stop string, the same tokens up to the one that completes the
    stop string's first occurrence, that one included; text == decode(ids), past the stop's end."""
    tok = reference.tokenizer
    for seed in range(40):
        full = engine.generate(PROMPTS[:1], max_new_tokens=24, seed=seed)[0]
        if not full.finished and (found := _stop_inside_a_token(tok, full.completion_ids)):
            break
    else:
        pytest.fail("no seed gave a completion with a multi-character token to stop inside")
    stop, j = found
    r = engine.generate(PROMPTS[:1], max_new_tokens=24, seed=seed, stop=[stop, "never seen"])[0]
    assert r.completion_ids == full.completion_ids[:j + 1]
    assert r.logprobs == pytest.approx(full.logprobs[:j + 1], abs=1e-5)
    assert r.text == tok.decode(r.completion_ids) and r.finished and r.stop == stop
    assert r.text_before_stop == full.text[:full.text.index(stop)]
    assert len(r.text) > len(r.text_before_stop) + len(stop)           # the last token runs past the stop


def test_stop_strings_in_a_batch(engine, reference):
    """Rows leave the batch at their own stop; each ends at the first token that completes one."""
    tok, stops = reference.tokenizer, ["t", "g"]
    out = engine.generate(PROMPTS, n=4, max_new_tokens=16, seed=3, stop=stops)
    assert sum(r.stop is not None for r in out) >= 3 and any(r.stop is None for r in out)
    for r in out:
        assert len(r.completion_ids) == len(r.logprobs)
        if r.stop is not None:
            assert r.finished and r.text == tok.decode(r.completion_ids)
            assert first_stop(tok.decode(r.completion_ids[:-1]), stops) is None     # not complete a token earlier
            assert first_stop(r.text, stops) == (len(r.text_before_stop), r.stop)
        elif not r.finished:
            assert len(r.completion_ids) == 16 and first_stop(r.text, stops) is None


# --- the HTTP API itself -------------------------------------------------------------------------


def _call(url, path, body=None, raw: bytes | None = None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"},
                                 method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_lists_the_model(server, checkpoints):
    status, body = _call(server, "/v1/models")
    assert status == 200 and body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == "tiny" and card["root"] == str(checkpoints[0]) and card["policy_version"] == 0
    assert card["max_model_len"] == tiny.TINY.max_seq_len


def test_completions_speak_openai(server, reference):
    """OpenAI's shape: text cut before the stop string, chosen tokens' log-probs, usage counts."""
    stop = "t"
    status, body = _call(server, "/v1/completions", {"model": "tiny", "prompt": PROMPTS[:2], "n": 2, "max_tokens": 8,
                                                      "temperature": 0.9, "seed": 2, "stop": stop, "logprobs": 0})
    assert status == 200 and body["object"] == "text_completion" and body["model"] == "tiny"
    ref = reference.generate(PROMPTS[:2], n=2, max_new_tokens=8, temperature=0.9, seed=2, stop=[stop])
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for c, r in zip(body["choices"], ref):
        assert c["text"] == r.text_before_stop and "token_ids" not in c
        assert c["finish_reason"] == ("stop" if r.finished else "length") and c["stop_reason"] == r.stop
        assert c["logprobs"]["token_logprobs"] == pytest.approx(r.logprobs, abs=1e-6)
        assert c["logprobs"]["tokens"] == [reference.tokenizer.decode([t]) for t in r.completion_ids]
    prompt_tokens = sum(len(ids) for ids in reference.encode_prompts(PROMPTS[:2]))
    completion_tokens = sum(len(r.completion_ids) for r in ref)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    status, one = _call(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0})
    assert status == 200 and len(one["choices"]) == 1 and one["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": [], "max_tokens": 4}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),                             # token ids: an empty prompt
    ({"prompt": [[1, -2]]}, "prompt"),
    ({"prompt": [[1, 300]]}, "prompt"),                                 # outside the 300-token vocabulary
    ({"prompt": ["a", [1, 2]]}, "prompt"),                              # text and ids mixed
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 63}, "max_tokens"),                # with BOS and "a": beyond the 64-token context
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "logprobs": 2}, "logprobs"),
    ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": "a", "stream": True}, "stream"),
    ({"prompt": "a", "top_p": 0.9}, "top_p"),
    ({"prompt": "a", "frequency_penalty": 0.5}, "frequency_penalty"),
    (b"{not json", None),
    # found by review: these were 500s, which HTTPEngine retries as transient
    ({"prompt": "a", "seed": 2**70}, "seed"),                         # beyond torch.Generator's 64 bits
    (b'{"prompt": "\\ud800", "max_tokens": 4}', "prompt"),             # a lone surrogate: no tokenizer encodes it
    (b'{"prompt": ["a", "b\\udc00"]}', "prompt"),
    (b'{"prompt": "a", "stop": ["\\ud800"]}', "stop"),              # a stop string that could never match, was ignored
])
def test_bad_requests_get_400_with_a_message(server, body, param):
    status, err = _call(server, "/v1/completions", raw=body if isinstance(body, bytes) else json.dumps(body).encode())
    assert status == 400, err
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
    if param is not None:
        assert err["error"]["param"] == param and err["error"]["message"].startswith(param)


def test_token_id_prompts_are_sampled_on_as_given(server, reference):
    """`prompt` as token ids (one list, or a list of lists, as vLLM takes them): no BOS added, no
    re-encoding; `prompt_token_ids` are those ids and the samples those of the engine on them."""
    ids = [reference.encode_prompts(PROMPTS[1:2])[0][1:], reference.encode_prompts(PROMPTS[:1])[0]]   # 1st: no BOS
    assert ids[0][0] != reference.tokenizer.bos_token_id
    status, body = _call(server, "/v1/completions", {"prompt": ids, "n": 2, "max_tokens": 6, "seed": 4, "logprobs": 0,
                                                      "return_token_ids": True})
    assert status == 200, body
    ref = reference.generate(ids, n=2, max_new_tokens=6, seed=4)
    assert [c["prompt_token_ids"] for c in body["choices"]] == [ids[0], ids[0], ids[1], ids[1]]
    assert [c["token_ids"] for c in body["choices"]] == [r.completion_ids for r in ref]
    assert body["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
    status, one = _call(server, "/v1/completions", {"prompt": ids[0], "max_tokens": 3, "return_token_ids": True})
    assert status == 200 and [c["prompt_token_ids"] for c in one["choices"]] == [ids[0]]


CHAT = ("{% for m in messages %}U:{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}A:{% endif %}")


def test_a_client_given_the_trainers_encoder_samples_on_its_token_ids(server, reference):
    """Found by review: the server encoded the raw text (no chat template) while the trainer trains on the
    chat-templated ids, so behaviour log-probs were conditioned on another context than pi_old's. Given
    `encode` (the trainer's encode_prompts), HTTPEngine sends those ids: the served samples, ids and
    log-probs are the in-process engine's on the trainer's own encoding."""
    import copy

    tok = copy.deepcopy(reference.tokenizer)
    tok.chat_template = CHAT
    trainer = TorchEngine(reference.model, tok, chat_template=True)        # what session.engine encodes with
    encoded = trainer.encode_prompts(PROMPTS)
    assert encoded != reference.encode_prompts(PROMPTS)                    # the template changes the ids
    engine = HTTPEngine(server, encode=trainer.encode_prompts)
    out = engine.generate(PROMPTS, n=2, max_new_tokens=8, temperature=0.8, seed=3)
    ref = trainer.generate(PROMPTS, n=2, max_new_tokens=8, temperature=0.8, seed=3)
    assert _fields(out) == _fields(ref)
    assert [r.prompt_ids for r in out] == [encoded[r.prompt_index] for r in out]
    for r, q in zip(out, ref):
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(q.logprobs), atol=1e-5, rtol=1e-5)


def test_a_server_that_samples_on_other_prompt_tokens_fails_the_request(reference):
    """A server that answers with other prompt_token_ids than it was sent (it re-encoded them, added a
    BOS): PromptMismatch, not retried, naming where the ids differ."""
    from ratchet.errors import is_transient
    from ratchet.rollout.client import PromptMismatch

    engine = HTTPEngine("http://127.0.0.1:9", encode=reference.encode_prompts)
    sent = reference.encode_prompts(PROMPTS[:1])[0]
    choice = {"index": 0, "text": "x", "token_ids": [7], "logprobs": {"token_logprobs": [-1.0]}, "finish_reason": "length"}
    engine._post = lambda path, body: {"choices": [{**choice, "prompt_token_ids": body["prompt"][0]}]}
    assert engine.generate(PROMPTS[:1], max_new_tokens=1)[0].prompt_ids == sent
    engine._post = lambda path, body: {"choices": [{**choice, "prompt_token_ids": [sent[0], *body["prompt"][0]]}]}
    with pytest.raises(PromptMismatch, match=r"other prompt tokens than the \d+ sent for prompt 0.*first difference "
                                             r"at token 1") as e:
        engine.generate(PROMPTS[:1], max_new_tokens=1)
    assert not is_transient(e.value)


def test_an_unknown_model_is_404_and_the_client_raises(server):
    status, err = _call(server, "/v1/completions", {"model": "other", "prompt": "a"})
    assert status == 404 and "tiny" in err["error"]["message"]
    with pytest.raises(EngineRequestError, match="400 logprobs"):
        HTTPEngine(server)._post("/v1/completions", {"prompt": "a", "logprobs": 1})
    with pytest.raises(EngineRequestError, match="400 seed"):       # not a TransientError: never retried
        HTTPEngine(server).generate(["a"], seed=2**70)


def test_a_server_failure_is_a_500_that_names_its_cause(server, monkeypatch):
    """Found by review: a failure inside `ratchet serve` answered a bare "Internal Server Error", and
    the client's TransientError said no more. Now the 500 carries the exception, and the client's error too."""
    import ratchet.rollout.server as served
    from ratchet.errors import TransientError

    def fail(*_args):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(served, "_complete", fail)
    status, err = _call(server, "/v1/completions", {"prompt": "a"})
    assert status == 500 and err["error"]["type"] == "server_error"
    assert err["error"]["message"] == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    with pytest.raises(TransientError, match="500 RuntimeError: CUDA out of memory"):
        HTTPEngine(server).generate(["a"], max_new_tokens=2)


def test_load_swaps_the_checkpoint_and_the_version(checkpoints):
    """/v1/load (set_policy_version) serves another checkpoint from the next request on; a bad
    path is refused and the old weights stay."""
    a, b = checkpoints
    other = TorchEngine(*load_policy(b))
    s = _LoopbackServer(a)
    try:
        engine = HTTPEngine(s.url, checkpoint_path=lambda v: str(b))
        sample = dict(max_new_tokens=10, seed=0)                         # both tiny models are greedy "\n\n\n..."
        before = engine.generate(PROMPTS, **sample)
        with pytest.raises(EngineRequestError, match="not a directory"):
            engine.set_policy_version(3, path=str(b / "missing"))
        assert _fields(engine.generate(PROMPTS, **sample)) == _fields(before)
        engine.set_policy_version(3)
        assert engine.policy_version == 3 and engine.models()[0]["policy_version"] == 3
        after = engine.generate(PROMPTS, **sample)
        assert _fields(after) == _fields(other.generate(PROMPTS, **sample))
        assert _fields(after) != _fields(before)
        status, card = _call(s.url, "/v1/load", {"path": str(a)})         # no version: the next one
        assert status == 200 and card["policy_version"] == 4 and card["root"] == str(a)
    finally:
        s.stop()


def test_torch_engine_records_the_version(reference):
    engine = TorchEngine(reference.model, reference.tokenizer)
    engine.set_policy_version(7)
    assert engine.policy_version == 7


def test_ratchet_serve_command(checkpoints, monkeypatch):
    """`ratchet serve` loads the checkpoint and hands uvicorn the app on the host and port asked."""
    import uvicorn

    from ratchet.cli import app

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app_, **kw: seen.update(app=app_, **kw))
    result = CliRunner().invoke(app, ["serve", "--model", str(checkpoints[0]), "--port", "8123"])
    assert result.exit_code == 0, result.output
    assert seen["host"] == "127.0.0.1" and seen["port"] == 8123
    assert seen["app"].state.served.model_card()["id"] == "tiny"
    result = CliRunner().invoke(app, ["serve", "--model", str(checkpoints[0] / "missing")])
    assert result.exit_code == 2


def test_ratchet_serve_names_what_is_wrong_with_a_model_directory_in_one_line(checkpoints, tmp_path):
    """Without tokenizer.json the tokenizer does not load: serve printed transformers' five-line error."""
    from ratchet.cli import app

    path = shutil.copytree(checkpoints[0], tmp_path / "model")
    (path / "tokenizer.json").unlink()
    result = CliRunner().invoke(app, ["serve", "--model", str(path)])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert result.stderr.startswith("error: the tokenizer does not load (ValueError: Couldn't instantiate the "
                                    "backend tokenizer"), result.stderr
