"""Multi-turn episodes on the embedded engine: the model answers, an observation comes back, the
model revises, up to K turns, with the KV cache of the conversation reused from turn to turn.

    def respond(turn, live):                    # live: [(episode_index, Turn), ...] of this turn's answers
        return [feedback(i, t.text_before_stop) for i, t in live]     # per episode: text to append, or None (done)

    episodes = generate_episodes(engine, prompts, n=4, respond=respond, max_turns=3, max_new_tokens=64, seed=0)
    ep.completion_ids, ep.logprobs, ep.loss_mask   # a1 o1 a2 o2 a3; observations: log-prob 0.0, mask 0
    prefill_figure(episodes)                       # prefill tokens per episode: KV reuse against recomputing
    generate_episodes(..., n=8, branch=2, ...)     # 4 first answers per prompt, each revised by 2 episodes apart

How a batch (up to `batch_size` episodes, grouped by prompt) runs (`_Conversations`):
- each distinct prompt is left-padded and prefilled ONCE; its KV cache rows are copied to its n
  episodes (as TorchEngine.generate does);
- a turn decodes all live episodes together, one token per step; a row whose answer has ended
  (EOS, a stop string) sits the remaining steps of the turn out: its column gets attention 0, so it
  changes nothing (positions count only real tokens), and once half the rows sit out they wait aside;
- then `respond` gives each episode its observation; an episode that ends leaves the batch, and
  the others append [the answer's last token, which no decode step forwarded] + the observation's
  tokens in ONE left-padded forward over the existing cache: the conversation is never re-prefilled.
The model's own forward with its DynamicCache does every step, so any causal LM works (the fused
Llama decode of ratchet/rollout/decoders.py serves single-turn `generate` only); its full-attention
layers grow in place (`_GrowingLayer`: columns written into spare room, not the cache concatenated
per step), and once half a turn's rows have ended their answers, those rows wait aside (`park`)
while the others decode on, and come back before the observations are appended (`unpark`: the
columns they missed are zeros at attention 0, as a row that sat the steps out has). Measured with
`python -m bench.rollout --episodes` (16 prompts x 8, 3 turns, 48-token observations, one thread):
1.11-1.24x the tokens/s of concatenation in place alone, 1.53-1.55x with parking; the same tokens.

Observation tokens: `tokenizer(obs, add_special_tokens=False)`, except that a special token's string
in it ("<eos>" an answer printed) is text, not that token (`text_ids`); with `engine.chat_template`
the observation is a user turn of the model's chat template (`observation_ids`). Log-probs, greedy,
seed and stop strings follow ratchet/rollout/engine.py, per turn: a 1-turn episode is what
`generate` samples. With `branch` b > 1, the n episodes of a prompt come in b-tuples that share their
first answer: it is sampled once, by the first of them (`Episode.shared_first` False), and copied,
token by token, into the others' rows (True), so that each failed first answer is revised b times
apart, from one state (a tree of depth 1: the revisions of one answer can be judged against each
other). tests/rollout/test_episodes.py checks every step's logits against a from-scratch forward of
the whole conversation.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from ratchet.model import text_ids
from ratchet.rollout.engine import check_room, first_stop
from ratchet.rollout.torch_engine import TorchEngine, _StopScanner, sample

__all__ = ["Episode", "Turn", "generate_episodes", "observation_ids", "prefill_figure"]

ENDS = ("done", "turns", "context")


@dataclass
class Turn:
    action_ids: list[int]        # sampled tokens of this answer (EOS / stop tokens included, as Rollout)
    action_logprobs: list[float] # behaviour log-probs, one per action token (as Rollout.logprobs)
    action_text: str             # decode(action_ids) without EOS (as Rollout.text)
    finished: bool               # ended by EOS / a stop string (not the max_new_tokens cap)
    stop: str | None
    observation: str | None = None                              # text appended after this answer (None: none was)
    observation_ids: list[int] = field(default_factory=list)    # its tokens, as the model saw them

    @property
    def text_before_stop(self) -> str:
        """The answer cut where its stop string starts (what a verifier gets); all of it without one."""
        cut = -1 if self.stop is None else self.action_text.find(self.stop)
        return self.action_text if cut < 0 else self.action_text[:cut]


@dataclass
class Episode:
    prompt_index: int
    prompt_ids: list[int]
    turns: list[Turn]
    end: str                     # "done" (respond returned None), "turns" (turn limit), "context" (no room left)
    prefill_tokens: float        # tokens forwarded outside one-token decode steps: prompt / its sharers in the
                                 # batch, + per appended observation its tokens and the answer's last token
    recompute_tokens: float      # the same if every turn after the first re-prefilled the whole conversation
    shared_first: bool = False   # its first answer is a copy of the one its branch's first episode sampled (branch > 1)

    @property
    def completion_ids(self) -> list[int]:
        """a1 + o1 + a2 + o2 + ... + aK: everything after the prompt, observations included."""
        return [t for turn in self.turns for t in turn.action_ids + turn.observation_ids]

    @property
    def logprobs(self) -> list[float]:
        """One per completion token: the behaviour log-prob on action tokens, 0.0 on observation tokens."""
        return [x for turn in self.turns for x in turn.action_logprobs + [0.0] * len(turn.observation_ids)]

    @property
    def loss_mask(self) -> list[int]:
        """One per completion token: 1 on the model's own (action) tokens, 0 on observation tokens."""
        return [m for turn in self.turns for m in [1] * len(turn.action_ids) + [0] * len(turn.observation_ids)]


class _GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys/values live in buffers with room to spare, so that appending q
    tokens writes q columns instead of copying the whole cache (DynamicLayer's `torch.cat`: this
    alone gives 1.11-1.24x the tokens/s on CPU, bench.rollout --episodes). Room doubles when it
    runs out, so a conversation of L tokens copies O(L) columns in all, not O(L^2). `keys`/`values`
    are views of the filled columns, so the model's attention and masks see what DynamicLayer shows.
    For no-grad rollout: the buffers are written in place (autograd through an earlier step's keys,
    or extending a cache filled under inference_mode outside it, would fail). Offloading is not
    supported (it raises)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k = self._v = None                                                 # [b, H, room, D]
        self._length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, q = self._length, key_states.shape[-2]
        if self._k is None or start + q > self._k.shape[-2]:
            room = max(start + q, 2 * start, 64)
            k = key_states.new_empty(*key_states.shape[:-2], room, key_states.shape[-1])
            v = value_states.new_empty(*value_states.shape[:-2], room, value_states.shape[-1])
            if start:
                k[..., :start, :], v[..., :start, :] = self.keys, self.values
            self._k, self._v = k, v
        self._k[..., start:start + q, :] = key_states
        self._v[..., start:start + q, :] = value_states
        self.load(self._k, self._v, start + q)
        return self.keys, self.values

    def load(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Take `keys`/`values` [b, H, room, D], of which the first `length` columns are filled, as the
        buffers; `self.keys`/`self.values` become views of those columns (the one place they are set)."""
        self.is_initialized, self.device = True, keys.device
        self._k, self._v, self._length = keys, values, length
        self.keys, self.values = keys[..., :length, :], values[..., :length, :]

    def _rows(self, select) -> None:
        """Apply `select` to the buffers' batch dim (rows leave, reorder or repeat) and re-point the views."""
        if self.is_initialized and self._k is not None:
            self.load(select(self._k), select(self._v), self._length)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows(lambda t: t[indices])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        """As DynamicLayer: a negative count drops that many columns from the end; the room stays."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop: a negative count of columns to remove, got {tokens_to_remove}")
        if tokens_to_remove and self.is_initialized and self._k is not None:
            self.load(self._k, self._v, max(0, self._length + tokens_to_remove))

    def offload(self):
        raise NotImplementedError("_GrowingLayer: offloading is not supported (rollout keeps its cache on device)")

    prefetch = offload


def _growing_cache(model) -> DynamicCache:
    """The model's DynamicCache with its full-attention layers growing in place (_GrowingLayer);
    other layer kinds (sliding windows) as the model makes them."""
    cache = DynamicCache(config=model.config)
    cache.layers = [_GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class _Conversations:
    """The KV cache of a batch of growing conversations, one row each: the left-padded prompts, one
    column per decode step (attention 0 where the row sat the step out), left-padded appended chunks.
    `logits` [b, V]: each row's next-token logits (float32); `length` [b]: its real tokens so far."""

    def __init__(self, model, prompts: list[list[int]], owner: torch.Tensor, pad: int):
        device = next(model.parameters()).device
        U, P = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((U, P), pad, dtype=torch.long)
        attn = torch.zeros((U, P), dtype=torch.long)
        for u, p in enumerate(prompts):
            ids[u, P - len(p):] = torch.tensor(p)
            attn[u, P - len(p):] = 1
        ids, attn, owner = ids.to(device), attn.to(device), owner.to(device)
        out = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                    cache=_growing_cache(model), use_cache=True, logits_to_keep=1)
        out.cache.batch_select_indices(owner)                                     # [U, ...] -> [b, ...]
        self.model, self.pad, self.cache, self.attn = model, pad, out.cache, attn[owner]  # attn: [b, L]
        self.length = attn.sum(-1)[owner]                                         # [b]
        self.logits = out.logits[:, -1].float()[owner]                            # [b, V]

    def step(self, tok: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Forward one token per row (tok [b]); rows where `active` [b] is False sit it out."""
        self.attn = torch.cat([self.attn, active[:, None].long()], dim=1)         # [b, L+1]
        out = self.model(input_ids=tok[:, None], attention_mask=self.attn, position_ids=self.length[:, None],
                         cache=self.cache, use_cache=True)
        self.cache, self.logits = out.cache, out.logits[:, -1].float()            # [b, V]
        self.length = self.length + active.long()
        return self.logits

    def extend(self, chunks: list[list[int]]) -> torch.Tensor:
        """Append each row's tokens (at least one) in one left-padded forward over the cache."""
        W, device = max(len(c) for c in chunks), self.attn.device
        ids = torch.full((len(chunks), W), self.pad, dtype=torch.long)
        mask = torch.zeros((len(chunks), W), dtype=torch.long)
        for r, c in enumerate(chunks):
            ids[r, W - len(c):] = torch.tensor(c)
            mask[r, W - len(c):] = 1
        ids, mask = ids.to(device), mask.to(device)
        pos = self.length[:, None] + (mask.cumsum(-1) - 1).clamp(min=0)          # [b, W]
        self.attn = torch.cat([self.attn, mask], dim=1)                          # [b, L+W]
        out = self.model(input_ids=ids, attention_mask=self.attn, position_ids=pos, cache=self.cache,
                         use_cache=True, logits_to_keep=1)
        self.cache, self.logits = out.cache, out.logits[:, -1].float()            # [b, V]
        self.length = self.length + mask.sum(-1)
        return self.logits

    def keep(self, idx: torch.Tensor) -> None:
        """Rows idx (ascending) stay; the others leave the batch and the cache."""
        idx = idx.to(self.attn.device)
        self.cache.batch_select_indices(idx)
        self.attn, self.length, self.logits = self.attn[idx], self.length[idx], self.logits[idx]

    @property
    def can_park(self) -> bool:
        """Every layer a _GrowingLayer (a sliding-window layer's cache is the model's own: no parking)."""
        return all(isinstance(layer, _GrowingLayer) for layer in self.cache.layers)

    def park(self, live: torch.Tensor) -> _Parked:
        """Rows `live` (ascending) decode on alone; the others wait, their cache and state set aside,
        until `unpark`: a row whose answer has ended costs no more compute for the rest of the turn."""
        live = live.to(self.attn.device)
        waiting = torch.ones(len(self.length), dtype=torch.bool, device=live.device)
        waiting[live] = False
        rows = waiting.nonzero().squeeze(1)
        kv = []
        for layer in self.cache.layers:       # a layer at a time: its old buffers go before the next is copied
            r, l = rows.to(layer.keys.device), live.to(layer.keys.device)   # (a model split across devices)
            kv.append((layer.keys[r], layer.values[r]))
            layer.batch_select_indices(l)
        parked = _Parked(live, rows, kv, self.attn[rows], self.length[rows], self.logits[rows])
        self.attn, self.length, self.logits = self.attn[live], self.length[live], self.logits[live]
        return parked

    def unpark(self, p: _Parked) -> None:
        """The rows `park` set aside come back, in the batch's order before it: the columns decoded
        while they waited hold zeros at attention 0, as a row that sat those steps out holds."""
        n, width = len(p.live) + len(p.rows), self.attn.shape[1]
        for i, layer in enumerate(self.cache.layers):
            (k, v), p.kv[i] = p.kv[i], None                     # each parked copy freed once it is back
            filled = k.shape[-2]
            bufs = []
            for live_part, parked_part in ((layer.keys, k), (layer.values, v)):
                buf = live_part.new_zeros(n, *live_part.shape[1:-2], layer._k.shape[-2], live_part.shape[-1])
                buf[p.live.to(buf.device), ..., :width, :] = live_part
                buf[p.rows.to(buf.device), ..., :filled, :] = parked_part
                bufs.append(buf)
            layer.load(*bufs, width)
        attn = self.attn.new_zeros(n, width)
        attn[p.live], attn[p.rows, :p.attn.shape[1]] = self.attn, p.attn
        length, logits = self.length.new_empty(n), self.logits.new_empty(n, self.logits.shape[1])
        length[p.live], length[p.rows] = self.length, p.length
        logits[p.live], logits[p.rows] = self.logits, p.logits
        self.attn, self.length, self.logits = attn, length, logits


@dataclass
class _Parked:
    live: torch.Tensor                                   # rows (of the batch before `park`) that went on
    rows: torch.Tensor                                   # rows set aside, and their state:
    kv: list[tuple[torch.Tensor, torch.Tensor] | None]   # per layer, keys and values [p, H, L, D] (None once back)
    attn: torch.Tensor
    length: torch.Tensor
    logits: torch.Tensor


_ANSWER = "\ue000answer\ue000"   # a private-use sentinel standing for the answer in a rendered template
_MESSAGE = "\ue000message\ue000"  # and for an observation


def chat_extension(tokenizer, prompt: str, observation: str) -> tuple[str, str]:
    """The chat template's rendering of (prompt, an answer standing in as _ANSWER) without, then with, a
    new user message `observation` and the generation prompt. ValueError when the second does not
    extend the first: the observation could not be appended over the KV cache. Preflight runs this
    on a probe when agent.turns > 1, so a template that cannot go on fails before the run starts."""
    before = [{"role": "user", "content": prompt}, {"role": "assistant", "content": _ANSWER}]
    without = tokenizer.apply_chat_template(before, tokenize=False)
    with_user = tokenizer.apply_chat_template(before + [{"role": "user", "content": observation}], tokenize=False,
                                              add_generation_prompt=True)
    if _ANSWER not in without or not with_user.startswith(without):
        raise ValueError("chat template: rendering the conversation with a new user message does not extend its "
                         "rendering without it, so an observation cannot be appended over the KV cache")
    return without, with_user


def observation_ids(engine: TorchEngine, prompt: str, turn: Turn, observation: str) -> list[int]:
    """The tokens that append `observation` after `turn`'s answer, as the model sees them.

    Plain: `text_ids(tokenizer, observation)`. With `engine.chat_template`: the template's close of
    the assistant turn (less the EOS the model already emitted, when the close starts with it), then
    what rendering the conversation with the new user message and the generation prompt adds to
    rendering it without; the template's special tokens are tokens, the observation is text."""
    tok = engine.tokenizer
    if not engine.chat_template:
        return text_ids(tok, observation)
    without, with_user = chat_extension(tok, prompt, observation)
    close = without[without.rindex(_ANSWER) + len(_ANSWER):]                      # e.g. "<|im_end|>\n"
    if turn.action_ids and turn.action_ids[-1] in engine.eos_ids:
        emitted = tok.decode(turn.action_ids[-1:], skip_special_tokens=False)
        close = close[len(emitted):] if emitted and close.startswith(emitted) else close
    added = close + with_user[len(without):]

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])
    if text_ids(tok, observation) == encode(observation):
        return encode(added)     # no special token's string in it (every ordinary observation): as rendered
    # The template's parts around the message, found with a stand-in for it, are encoded as ever; the message as text.
    head, found, tail = chat_extension(tok, prompt, _MESSAGE)[1][len(without):].partition(_MESSAGE)
    head = close + head
    if not found or len(added) < len(head) + len(tail) or not (added.startswith(head) and added.endswith(tail)):
        return encode(added)     # a template that does not render the message in one piece: as rendered
    return encode(head) + text_ids(tok, added[len(head):len(added) - len(tail)]) + encode(tail)


Respond = Callable[[int, list[tuple[int, Turn]]], Sequence[str | None]]


@torch.no_grad()
def generate_episodes(engine: TorchEngine, prompts: list[str], n: int, respond: Respond, max_turns: int,
                      max_new_tokens: int = 48, temperature: float = 1.0, greedy: bool = False,
                      seed: int | None = None, stop: Sequence[str] | None = None, batch_size: int = 128,
                      branch: int = 1) -> list[Episode]:
    """len(prompts) * n episodes grouped by prompt (like generate). At each turn every live episode
    samples an answer; then respond(turn, [(episode_index, Turn), ...] for the live ones), turn 0-based,
    returns per episode the observation to append (None: the episode ends, end="done"). respond is
    called after every turn, the last included, once per batch of up to batch_size episodes; after
    max_turns answers an episode ends with end="turns" whatever it returned. An episode whose next turn
    would not fit in the model's context (prompt + completion + observation + max_new_tokens > context,
    when the engine checks its context) ends with end="context", that observation not appended. An
    observation of no tokens is a ValueError (the loss mask tells answers apart by what lies between
    them); to end an episode, respond returns None. `branch` b: each first answer is shared by b
    consecutive episodes of its prompt (module docstring); n must be a multiple of b."""
    for name, value in (("n", n), ("max_turns", max_turns), ("max_new_tokens", max_new_tokens),
                        ("batch_size", batch_size), ("branch", branch)):
        if value < 1:
            raise ValueError(f"generate_episodes: {name} must be at least 1, got {value}")
    if n % branch:
        raise ValueError(f"generate_episodes: n ({n}) must be a multiple of branch ({branch}), so that every first "
                         f"answer is shared by {branch} episodes of its prompt")
    if stop is not None and any(not s for s in stop):
        raise ValueError("stop: every stop string must be non-empty")
    encoded = engine.encode_prompts(prompts)
    context = getattr(engine, "context", None)
    check_room(encoded, max_new_tokens, context)   # as generate: PromptTooLong naming the prompt
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, greedy=greedy, stop=list(stop or []),
                    gen=torch.Generator().manual_seed(seed) if seed is not None else None)
    jobs = [(i, encoded[i]) for i in range(len(prompts)) for _ in range(n)]
    step = max(branch, batch_size - batch_size % branch)     # a batch never splits the episodes of one first answer
    episodes: list[Episode] = []
    was_training = engine.model.training
    engine.model.eval()
    try:
        for start in range(0, len(jobs), step):
            episodes += _batch(engine, prompts, jobs[start:start + step], start, respond, max_turns, context,
                               sampling, branch)
    finally:
        engine.model.train(was_training)
    return episodes


def _batch(engine, prompts, jobs, first, respond, max_turns, context, sampling, branch=1) -> list[Episode]:
    """The episodes of jobs[(prompt index, prompt ids)] (grouped by prompt); `first`: the first's index
    (a multiple of `branch`, as len(jobs) is)."""
    sharers = Counter(i for i, _ in jobs)
    owner = torch.unique_consecutive(torch.tensor([i for i, _ in jobs]), return_inverse=True)[1]
    distinct = [ids for b, (i, ids) in enumerate(jobs) if b == 0 or jobs[b - 1][0] != i]
    conv = _Conversations(engine.model, distinct, owner, engine.pad)
    turns: list[list[Turn]] = [[] for _ in jobs]
    end: list[str] = ["turns"] * len(jobs)
    prefill = [len(ids) / sharers[i] for i, ids in jobs]        # the prompt's prefill, shared by its rows
    recompute = list(prefill)
    rows = list(range(len(jobs)))                               # conversation row -> job
    leader = torch.arange(len(jobs)) // branch * branch        # the episode whose first answer each one shares
    for k in range(max_turns):
        answers = _decode_turn(engine, conv, copy_from=leader if k == 0 and branch > 1 else None, **sampling)
        for b, turn in zip(rows, answers):
            turns[b].append(turn)
        replies = _replies(respond, k, [(first + b, turn) for b, turn in zip(rows, answers)])
        stay, chunks = [], []
        for r, (b, turn, obs) in enumerate(zip(rows, answers, replies)):
            if k == max_turns - 1 or obs is None:
                end[b] = "turns" if k == max_turns - 1 else "done"
                continue
            i, prompt_ids = jobs[b]
            ids = observation_ids(engine, prompts[i], turn, obs)
            if not ids:   # the loss mask tells answers apart by the observation tokens between them
                raise ValueError(f"respond(turn {k}): episode {first + b}'s observation {obs!r} is no tokens, so "
                                 f"its next answer would run into this one; return None to end the episode")
            so_far = len(prompt_ids) + sum(len(t.action_ids) + len(t.observation_ids) for t in turns[b])
            if context is not None and so_far + len(ids) + sampling["max_new_tokens"] > context:
                end[b] = "context"
                continue
            turn.observation, turn.observation_ids = obs, ids
            stay.append(r)
            chunks.append(turn.action_ids[-1:] + ids)          # the answer's last token: no decode step took it
            prefill[b] += len(chunks[-1])
            recompute[b] += so_far + len(ids)                  # the next turn re-prefilling the conversation
        if not stay:
            break
        conv.keep(torch.tensor(stay))
        rows = [rows[r] for r in stay]
        conv.extend(chunks)
    return [Episode(i, ids, turns[b], end[b], prefill[b], recompute[b], shared_first=b % branch > 0)
            for b, (i, ids) in enumerate(jobs)]


def _replies(respond: Respond, k: int, live: list[tuple[int, Turn]]) -> list[str | None]:
    replies = respond(k, live)
    if replies is None or isinstance(replies, str) or len(replies) != len(live):
        got = "None" if replies is None else f"{type(replies).__name__} of length {len(replies)}"
        raise ValueError(f"respond(turn {k}): must return one observation (str or None) per live episode, "
                         f"{len(live)} here; got {got}")
    bad = [(i, type(o).__name__) for (i, _), o in zip(live, replies) if o is not None and not isinstance(o, str)]
    if bad:
        raise TypeError(f"respond(turn {k}): episode {bad[0][0]}'s observation is a {bad[0][1]}, not str or None")
    return list(replies)


def _decode_turn(engine, conv: _Conversations, max_new_tokens, temperature, greedy, gen, stop,
                 copy_from: torch.Tensor | None = None) -> list[Turn]:
    """One answer per conversation row, decoded together; rows whose answer ended sit the rest out.
    `copy_from` [B]: row b takes row copy_from[b]'s token and log-prob at every step (rows of one prompt,
    whose logits are the same: its answer is that row's, sampled once; both end at the same step)."""
    B, device = len(conv.length), conv.length.device
    eos, eos_t = set(engine.eos_ids), torch.tensor(engine.eos_ids, device=device)
    active = torch.ones(B, dtype=torch.bool, device=device)                      # [B] answer still going
    tokens: list[list[int]] = [[] for _ in range(B)]
    logps: list[list[float]] = [[] for _ in range(B)]
    scanner = _StopScanner(engine.tokenizer, stop, B) if stop else None
    logits = conv.logits                                                          # [B, V]
    rows = torch.arange(B, device=device)              # conv row -> its answer (parking drops conv rows)
    parked: list[_Parked] = []
    for t in range(max_new_tokens):
        idx = active.nonzero().squeeze(1)                                         # [b] live rows, ascending
        logprobs = torch.log_softmax(logits[idx] / (1.0 if greedy else temperature), dim=-1)  # [b, V]
        tok = logprobs.argmax(-1) if greedy else sample(logprobs.exp().cpu(), gen).to(device)  # [b]
        chosen = logprobs.gather(1, tok[:, None]).squeeze(1)                     # [b]
        if copy_from is not None:   # rows[idx]: the live answers; a copy and its source are live together
            tok, chosen = _copied(tok, chosen, rows[idx], copy_from.to(device), B)
        answer = rows[idx].tolist()
        for b, x, lp in zip(answer, tok.tolist(), chosen.tolist()):
            tokens[b].append(x)
            logps[b].append(lp)
        done = torch.isin(tok, eos_t)                                             # [b]
        if scanner is not None:
            done |= torch.tensor(scanner.step(answer, tok.tolist(), eos), dtype=torch.bool, device=device)
        active[idx[done]] = False
        if t == max_new_tokens - 1 or not bool(active.any()):
            break
        step = torch.full((len(active),), engine.pad, dtype=torch.long, device=device)  # sat-out rows: pad, masked
        step[idx] = tok
        live = active.nonzero().squeeze(1)
        if 2 * len(live) <= len(active) and max_new_tokens - t > 4 and conv.can_park:  # half sit out: aside
            # (a few steps before the cap, the two copies of setting aside would cost more than they save)
            parked.append(conv.park(live))
            rows, step, active = rows[live], step[live], active[live]
        logits = conv.step(step, active)
    for p in reversed(parked):                         # every row back, in the batch's order
        conv.unpark(p)
    answers = []
    for b in range(B):
        ids = tokens[b]
        ended = ids[-1] in eos
        text = engine.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
        hit = scanner.hit.get(b) if scanner is not None else None
        if hit is not None:   # the full text's earliest stop, as generate
            hit = (first_stop(text, stop) or (0, hit))[1]
        answers.append(Turn(ids, logps[b], text, ended or hit is not None, hit))
    return answers


def _copied(tok: torch.Tensor, chosen: torch.Tensor, answers: torch.Tensor, copy_from: torch.Tensor, B: int):
    """tok, chosen [b] of the live `answers` [b] (of B) -> each answer's source's token and log-prob."""
    at = torch.full((B,), -1, dtype=torch.long, device=tok.device)
    at[answers] = torch.arange(len(answers), device=tok.device)                # answer -> its place in the step
    src = at[copy_from[answers]]                                              # [b]
    if bool((src < 0).any()):
        raise RuntimeError("generate_episodes: an episode sharing a first answer is live while its source is not")
    return tok[src], chosen[src]


def prefill_figure(episodes: Sequence[Episode]) -> dict:
    """Mean prefill tokens per episode with KV reuse and with recomputing the conversation every turn,
    and their ratio (reuse / recompute: below 1 is the saving)."""
    if not episodes:
        raise ValueError("prefill_figure: no episodes")
    reuse = sum(e.prefill_tokens for e in episodes) / len(episodes)
    recompute = sum(e.recompute_tokens for e in episodes) / len(episodes)
    return {"episodes": len(episodes), "mean_turns": sum(len(e.turns) for e in episodes) / len(episodes),
            "prefill_tokens_reuse": reuse, "prefill_tokens_recompute": recompute,
            "reuse_over_recompute": reuse / recompute}
