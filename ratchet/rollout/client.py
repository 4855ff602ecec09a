"""A rollout engine reached over HTTP: `ratchet serve`, or a vLLM OpenAI server (ratchet/rollout/vllm.py).

    engine = HTTPEngine("http://127.0.0.1:8000", checkpoint_path=lambda v: f"runs/r/checkpoints/{v}")
    rollouts = engine.generate(prompts, n=8, max_new_tokens=48, seed=0)    # same contract as TorchEngine
    engine.set_policy_version(4)                                          # POST /v1/load of checkpoint 4

One POST /v1/completions per `generate`, asking for what a trainer needs beyond OpenAI's fields,
under vLLM's names: `logprobs: 0` (the chosen tokens' log-probs), `return_token_ids: true` (the
sampled ids, so nothing is re-tokenised) and `include_stop_str_in_output: true` (the text of
exactly those ids). `batch_size` is sent as a ratchet extension (vLLM ignores unknown fields,
with a warning). The interface: ratchet/rollout/engine.py.

Against vLLM (not run here: no GPU): start it with `--logprobs-mode processed_logprobs`, or its
log-probs are the raw logits' and not the behaviour policy's at temperature != 1. vLLM keeps
the tokens after a stop string's end inside the last token out of `text`, while ratchet keeps
them (its text is decode(ids)). vLLM has no /v1/load: its weight sync is the dev-mode
weight-transfer API (NCCL/IPC); `VLLMEngine` (vllm.py) syncs by reloading from a directory instead.

Prompts: given `encode` (a run's behaviour engine is given the trainer's own, the session engine's
`encode_prompts`: BOS, and the chat template when the run uses one), each prompt is sent as the
token ids the trainer will train on (`prompt` as a list of id lists, which vLLM and `ratchet serve`
both take as they are), so the behaviour log-probs are conditioned on exactly the trainer's
context; a server that answers with other `prompt_token_ids` fails the request (`PromptMismatch`).
Without `encode` the text is sent and the server tokenises it its own way: `ratchet serve` as
plain text with BOS, vLLM with its tokenizer's special-token template (for ratchet's embedded
tokenizer: no BOS), neither through a chat template.

Errors: a 4xx answer raises `EngineRequestError` (the request is wrong: not retried); a 5xx,
a refused or dropped connection or a timeout raise `TransientError`/`OSError`
(ratchet.errors.is_transient: retried by the tasks). So does an answer sampled with another
`policy_version` than the engine's (`ratchet serve` restarted on its original checkpoint): the
behaviour engine then syncs the server again before the retry samples (behaviour.py `at`).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Callable, Sequence

from ratchet.errors import TransientError
from ratchet.rollout.engine import Rollout


class EngineRequestError(ValueError):
    """The server refused the request (4xx): the same request would fail again."""


class PromptMismatch(RuntimeError):
    """The server sampled on other prompt token ids than it was sent: its samples are not conditioned on
    what the trainer trains on. Not retried (the same server would do it again)."""


class HTTPEngine:
    tracks_version = True    # the server is told each version (/v1/load) and answers the one it sampled with

    def __init__(self, base_url: str, model: str | None = None, timeout_s: float = 600.0,
                 checkpoint_path: Callable[[int], str] | None = None, policy_version: int = 0,
                 encode: Callable[[list[str]], list[list[int]]] | None = None):
        self.base_url = base_url.rstrip("/")
        self.model, self.timeout_s, self.checkpoint_path = model, timeout_s, checkpoint_path
        self.policy_version = policy_version
        self.encode = encode    # prompts -> the token ids sampled on (the trainer's encode_prompts); None: send text

    def generate(self, prompts: list[str], n: int = 1, max_new_tokens: int = 48, temperature: float = 1.0,
                 greedy: bool = False, batch_size: int = 128, seed: int | None = None,
                 stop: Sequence[str] | None = None) -> list[Rollout]:
        """len(prompts) * n rollouts grouped by prompt, with ids and behaviour log-probs (engine.py)."""
        encoded = self.encode(list(prompts)) if self.encode is not None else None
        body = {"prompt": encoded if encoded is not None else list(prompts), "n": n, "max_tokens": max_new_tokens,
                "temperature": 0.0 if greedy else temperature, "logprobs": 0, "return_token_ids": True,
                "include_stop_str_in_output": True, "batch_size": batch_size}
        if self.model is not None:
            body["model"] = self.model
        if seed is not None:
            body["seed"] = seed
        if stop:
            body["stop"] = list(stop)
        resp = self._post("/v1/completions", body)
        served = resp.get("policy_version")      # ratchet serve's; vLLM names none
        if self.tracks_version and served is not None and served != self.policy_version:
            raise TransientError(f"{self.base_url}: the server sampled with policy version {served}, not "
                                 f"{self.policy_version} as this engine was synced to (was it restarted on "
                                 f"another checkpoint?): a retry syncs it again")
        choices = sorted(resp["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts) * n:
            raise TransientError(f"{self.base_url}: {len(choices)} choices for {len(prompts)} prompts x n={n}")
        return [self._rollout(c, c["index"] // n, encoded) for c in choices]

    def set_policy_version(self, version: int, path: str | None = None) -> None:
        """Ask the server to load the checkpoint of `version` (`path`, or checkpoint_path(version))."""
        if path is None and self.checkpoint_path is None:
            raise ValueError("set_policy_version: give the checkpoint's path, or construct HTTPEngine "
                             "with checkpoint_path")
        path = path if path is not None else self.checkpoint_path(version)
        self._post("/v1/load", {"path": str(path), "version": version})
        self.policy_version = version

    def models(self) -> list[dict]:
        return self._request("GET", "/v1/models")["data"]

    def _rollout(self, c: dict, prompt_index: int, encoded: list[list[int]] | None) -> Rollout:
        ids, logprobs = c.get("token_ids"), (c.get("logprobs") or {}).get("token_logprobs")
        if ids is None or logprobs is None or len(ids) != len(logprobs):
            raise EngineRequestError(f"{self.base_url}: choice {c['index']} lacks token_ids or token_logprobs, or "
                                     f"their lengths differ: is this server OpenAI-only (no return_token_ids)?")
        got = c.get("prompt_token_ids")
        if encoded is not None and got is not None and list(got) != encoded[prompt_index]:
            sent = encoded[prompt_index]
            at = next((i for i, (a, b) in enumerate(zip(sent, got)) if a != b), min(len(sent), len(got)))
            raise PromptMismatch(f"{self.base_url}: choice {c['index']} was sampled on other prompt tokens than the "
                                 f"{len(sent)} sent for prompt {prompt_index} ({len(got)} tokens, first difference "
                                 f"at token {at}: sent {sent[at:at + 5]}, got {list(got)[at:at + 5]}): its log-probs "
                                 f"are not conditioned on what the trainer trains on")
        stop = c.get("stop_reason") if isinstance(c.get("stop_reason"), str) else None
        prompt_ids = encoded[prompt_index] if encoded is not None else list(got or [])
        return Rollout(prompt_index, prompt_ids, ids, [float(x) for x in logprobs],
                       c["text"], c.get("finish_reason") == "stop", stop)

    def _post(self, path: str, body: dict) -> dict:
        return self._request("POST", path, body)

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
                return json.loads(raw) if raw.strip() else {}   # some control endpoints answer 200 with no body
        except urllib.error.HTTPError as e:   # an answer, not a network failure
            message = _error_message(e)
            if e.code >= 500:
                raise TransientError(f"{method} {self.base_url}{path}: {e.code} {message}") from None
            raise EngineRequestError(f"{method} {self.base_url}{path}: {e.code} {message}") from None


def _error_message(e: urllib.error.HTTPError) -> str:
    raw = e.read().decode(errors="replace")
    try:
        err = json.loads(raw)
        err = err.get("error", err) if isinstance(err, dict) else err
        return err.get("message", raw) if isinstance(err, dict) else raw
    except ValueError:
        return raw
