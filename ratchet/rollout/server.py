"""`ratchet serve`: the torch rollout engine behind an OpenAI-compatible HTTP API.

    ratchet serve --model runs/r/checkpoints/3 --port 8000 [--host 127.0.0.1]
    curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"prompt": "def f(x):", "max_tokens": 16, "temperature": 0, "logprobs": 0}'

Endpoints:
- `GET /v1/models`: the served model (`id`, `root` = checkpoint directory, `max_model_len`, and
  ratchet's `policy_version`).
- `POST /v1/completions`: OpenAI's legacy completions. `prompt`: a string or a list of strings, each
  encoded as plain text with BOS (no chat template: `ratchet.model.encode_prompts`), or, as vLLM takes
  them, token ids (a list of ints, or a list of such lists) sampled on exactly as given: ratchet's
  client sends the ids its trainer encodes (ratchet/rollout/client.py). `max_tokens` (default 16),
  `temperature` (0 = greedy; default 1), `n`, `seed`, `stop` (a string or a list), `logprobs: 0`
  (the chosen tokens' log-probs in `choices[i].logprobs.token_logprobs`, their text in `.tokens`;
  top alternatives, `logprobs > 0`, are not served). Choices are grouped by prompt: choice
  `i*n + j` is sample j of prompt i. Extensions, named as vLLM names them:
  `return_token_ids: true` adds `choices[i].token_ids` (every sampled token: the stop string's
  and EOS included) and `choices[i].prompt_token_ids`; `include_stop_str_in_output: true` makes
  `text` the decoding of exactly those ids (ratchet's token-accurate text; otherwise `text` is cut
  where the stop string starts, as OpenAI does); `choices[i].stop_reason` is the stop string
  that ended it. Ratchet's own: `batch_size` (sequences decoded together; default --batch-size)
  and the response's `policy_version`. The log-probs are under logits / temperature (raw logits
  when greedy): the behaviour log-probs a trainer needs (ratchet/rollout/engine.py).
- `POST /v1/load` (ratchet extension, for weight sync): `{"path": DIR, "version": V}` loads the
  checkpoint directory DIR (Hugging Face layout) and serves it as policy version V (default: the
  current version + 1) from the next request on. A bad path answers 400 and the old weights stay.
- `GET /health`: 200 once serving.

Bad input answers 400 with OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`;
a failure of the server itself answers 500 in the same shape, the exception's type and text its message.
Requests are served one at a time (a lock): the engine batches within a request.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Annotated, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ratchet.errors import picklable
from ratchet.model import load_policy
from ratchet.rollout.engine import Rollout
from ratchet.rollout.torch_engine import TorchEngine


@picklable
class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


TokenIds = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, description="Must name the served model when given.")
    prompt: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="One prompt or a list: text (encoded here, without a chat template), or token ids (a list of "
                    "ints, or a list of such lists) taken as they are.")
    max_tokens: int = Field(16, ge=1, le=65536)
    temperature: float = Field(1.0, ge=0, le=5.0, description="0 = greedy.")
    n: int = Field(1, ge=1, le=1024)
    seed: int | None = Field(None, ge=-2**63, le=2**64 - 1, description="What torch.Generator takes: -2**63 to 2**64 - 1.")
    stop: str | list[str] | None = None
    logprobs: int | None = Field(None, ge=0, le=5, description="0: the chosen tokens' log-probs (> 0: not served).")
    return_token_ids: bool = False
    include_stop_str_in_output: bool = False
    batch_size: int | None = Field(None, ge=1, le=65536, description="ratchet: sequences decoded together.")
    # accepted at their defaults only: anything else would change what is sampled or returned
    stream: Literal[False] = False
    echo: Literal[False] = False
    top_p: Literal[1, 1.0] = 1.0
    user: str | None = None

    @field_validator("prompt", "stop")
    @classmethod
    def _unicode(cls, v):
        """JSON may escape a lone surrogate ("\\ud800"); no tokenizer encodes one, so it is the client's error (400)."""
        for i, s in enumerate([v] if isinstance(v, str) else v or []):
            if not isinstance(s, str):          # token ids
                continue
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:
                where = "" if isinstance(v, str) else f"string {i}: "
                raise ValueError(f"{where}a lone surrogate ({s[e.start]!r}) at character {e.start} is not Unicode text") from None
        return v


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="Checkpoint directory (Hugging Face layout).")
    version: int | None = Field(None, ge=0, description="Policy version it is; default: the current one + 1.")


class Served:
    """The engine, its checkpoint and version; swapped whole by /v1/load."""

    def __init__(self, path: str, name: str, batch_size: int, version: int = 0):
        self.name, self.batch_size, self.lock = name, batch_size, threading.Lock()
        self.path, self.engine = str(path), _load_engine(path, version)

    def load(self, path: str, version: int) -> None:
        engine = _load_engine(path, version)       # outside the lock: requests go on with the old weights
        with self.lock:
            self.path, self.engine = str(path), engine

    def model_card(self) -> dict:
        cfg = self.engine.model.config
        return {"id": self.name, "object": "model", "created": int(time.time()), "owned_by": "ratchet",
                "root": self.path, "max_model_len": getattr(cfg, "max_position_embeddings", None),
                "policy_version": self.engine.policy_version}


def _load_engine(path: str, version: int) -> TorchEngine:
    if not Path(path).is_dir():
        raise BadRequest(f"path: {path} is not a directory", "path")
    try:
        model, tokenizer = load_policy(path)
    except Exception as e:   # a directory that is not a loadable checkpoint
        raise BadRequest(f"path: cannot load a model from {path}: {type(e).__name__}: {e}", "path") from e
    return TorchEngine(model.eval(), tokenizer, policy_version=version)


def create_app(model: str, name: str | None = None, batch_size: int = 128) -> FastAPI:
    served = Served(model, name or Path(model).resolve().name, batch_size)
    app = FastAPI(title="ratchet serve", description=__doc__)
    app.state.served = served

    @app.exception_handler(BadRequest)
    def bad_request(_req: Request, e: BadRequest):
        return _error(e.status, e.message, e.param)

    @app.exception_handler(Exception)
    def server_error(_req: Request, e: Exception):
        """Anything else (out of memory, a bug): 500 with its cause, which the client's error shows."""
        return _error(500, f"{type(e).__name__}: {e}"[:2000], None)

    @app.exception_handler(RequestValidationError)
    def invalid(_req: Request, e: RequestValidationError):
        first = e.errors()[0]
        fields = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid" or not fields:
            return _error(400, f"body: {first.get('msg', 'invalid')}", None)
        return _error(400, f"{fields[0]}: {first.get('msg', 'invalid')}", fields[0])

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [served.model_card()]}

    @app.post("/v1/load")
    def load(req: LoadRequest) -> dict:
        served.load(req.path, served.engine.policy_version + 1 if req.version is None else req.version)
        return served.model_card()

    @app.post("/v1/completions")
    def completions(req: CompletionRequest) -> dict:
        with served.lock:
            return _complete(served, req)

    return app


def _complete(served: Served, req: CompletionRequest) -> dict:
    if req.model is not None and req.model != served.name:
        raise BadRequest(f"model: {req.model!r} is not served here; this server serves {served.name!r}", "model", 404)
    if req.logprobs:
        raise BadRequest("logprobs: top alternatives (logprobs > 0) are not served; pass 0 for the chosen "
                         "tokens' log-probs", "logprobs")
    one = isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int))   # text, or token ids
    prompts = [req.prompt] if one else req.prompt
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if not prompts:
        raise BadRequest("prompt: the list of prompts is empty", "prompt")
    if any(not s for s in stops):
        raise BadRequest("stop: every stop string must be non-empty", "stop")
    engine = served.engine
    given = not isinstance(prompts[0], str)      # token ids: sampled on as they are
    encoded = [list(p) for p in prompts] if given else engine.encode_prompts(prompts)
    context = getattr(engine.model.config, "max_position_embeddings", None)
    vocab = engine.model.config.vocab_size
    for i, ids in enumerate(encoded):
        if not ids:
            raise BadRequest(f"prompt: prompt {i} is empty" + ("" if given else " and the tokenizer has no BOS token"),
                             "prompt")
        if given and max(ids) >= vocab:
            raise BadRequest(f"prompt: prompt {i} has token id {max(ids)}, outside the model's vocabulary of {vocab}",
                             "prompt")
        if context and len(ids) + req.max_tokens > context:
            raise BadRequest(f"max_tokens: {req.max_tokens} after prompt {i}'s {len(ids)} tokens exceeds the "
                             f"model's context of {context}", "max_tokens")
    greedy = req.temperature == 0
    rollouts = engine.generate(encoded if given else prompts, n=req.n, max_new_tokens=req.max_tokens,
                               temperature=1.0 if greedy else req.temperature, greedy=greedy,
                               batch_size=req.batch_size or served.batch_size, seed=req.seed, stop=stops)
    choices = [_choice(k, r, req, engine.tokenizer) for k, r in enumerate(rollouts)]
    completion_tokens = sum(len(r.completion_ids) for r in rollouts)
    prompt_tokens = sum(len(ids) for ids in encoded)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": served.name, "policy_version": engine.policy_version, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def _choice(index: int, r: Rollout, req: CompletionRequest, tokenizer) -> dict:
    text = r.text if req.include_stop_str_in_output else r.text_before_stop
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": "stop" if r.finished else "length",
              "stop_reason": r.stop}
    if req.logprobs is not None:
        choice["logprobs"] = {"tokens": [tokenizer.decode([t]) for t in r.completion_ids],
                              "token_logprobs": r.logprobs, "top_logprobs": None, "text_offset": None}
    if req.return_token_ids:
        choice["token_ids"], choice["prompt_token_ids"] = r.completion_ids, r.prompt_ids
    return choice


def _error(status: int, message: str, param: str | None) -> JSONResponse:
    kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, name: str | None = None,
          batch_size: int = 128) -> None:
    """Load `model` and serve it until interrupted (the body of `ratchet serve`)."""
    import uvicorn

    uvicorn.run(create_app(model, name, batch_size), host=host, port=port, log_level="info")

