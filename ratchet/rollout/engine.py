"""The rollout engine interface: what a wave, the evaluation and the trainer ask of any engine.

    engine: RolloutEngine = TorchEngine(model, tokenizer)        # in-process (ratchet/rollout/torch_engine.py)
    engine: RolloutEngine = HTTPEngine("http://127.0.0.1:8000")   # `ratchet serve` or a vLLM server (client.py)
    rollouts = engine.generate(prompts, n=8, max_new_tokens=48, temperature=1.0, seed=0, stop=["\\n\\n"])
    engine.set_policy_version(3, path="runs/r/checkpoints/3")    # sample from policy version 3 from now on

The contract, held for every engine by tests/rollout/test_engine_contract.py:

- `generate` returns len(prompts) * n rollouts grouped by prompt: prompt 0's n samples first.
- `completion_ids` are the sampled tokens, the EOS token included when the model emitted it;
  `logprobs[i]` is log softmax(logits / temperature)[completion_ids[i]] under the policy that
  sampled it (the behaviour log-probs the trainer's importance ratios are taken against).
  `greedy=True` takes the argmax; its log-probs are those of the unscaled logits (temperature
  is ignored), as an OpenAI server's `temperature: 0` gives.
- `seed` makes sampling reproducible on one engine and batch layout.
- `stop` strings: generation of a sequence ends at the token that completes the first occurrence
  of any stop string. That token and those before it are the completion, so ids, log-probs and
  text stay token-accurate: `text == decode(completion_ids)` (without EOS), which ends with the
  stop string, or runs past it to the end of the token that completed it. The stop tokens stay in
  the ids, like EOS, because the policy is trained on its choice to stop. `Rollout.stop` names
  the stop string (the earliest-starting one, if several), and `text_before_stop` is the text cut
  where it starts (what an OpenAI server returns as `text`: give that to a verifier).
- `finished` is True when the sequence ended by itself (EOS or a stop string), False when the
  `max_new_tokens` cap cut it.
- `policy_version` is the version the next `generate` samples from; `set_policy_version(v, path)`
  moves there: the in-process engine shares the trainer's weights, so it only records v; a
  server engine asks its server to load the checkpoint directory `path` of version v.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence, runtime_checkable

from ratchet.errors import picklable


@dataclass
class Rollout:
    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]   # includes the EOS token, or the tokens of the stop string, when finished
    logprobs: list[float]       # one per completion token
    text: str                   # decode(completion_ids) without EOS; includes the stop string
    finished: bool              # ended by EOS or a stop string (not by the length cap)
    stop: str | None = None     # the stop string that ended it, if one did

    @property
    def text_before_stop(self) -> str:
        """The text cut where the stop string starts (OpenAI's `text`); all of it without a stop."""
        cut = -1 if self.stop is None else self.text.find(self.stop)
        return self.text if cut < 0 else self.text[:cut]


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(index, stop) of the earliest-starting stop string in `text` (the longest at a tie), or None."""
    found = [(i, -len(s), s) for s in stops if (i := text.find(s)) >= 0]
    if not found:
        return None
    i, _, s = min(found)
    return i, s


@picklable   # raised in a process pool (bench.multiturn) and kept in Prefect's result store
class PromptTooLong(ValueError):
    """A prompt whose tokens + max_new_tokens exceed the model's context: the engine's last guard (the
    nightly drops such tasks for the run first, `ratchet.room`). `index` is the first such prompt's;
    a caller that knows its task names it (`naming_tasks`)."""

    def __init__(self, index: int, tokens: int, max_new_tokens: int, context: int, count: int = 1,
                 task_id: str | None = None):
        self.index, self.tokens, self.max_new_tokens, self.context, self.count, self.task_id = (
            index, tokens, max_new_tokens, context, count, task_id)
        who = f"task {task_id} (prompt {index})" if task_id is not None else f"prompt {index}"
        super().__init__(f"{who}: {tokens} tokens + max_new_tokens {max_new_tokens} exceed the model's context of "
                         f"{context} tokens ({count} prompt(s) too long)")


def fits(tokens: int, max_new_tokens: int, context: int) -> bool:
    """A prompt of `tokens` tokens leaves room for `max_new_tokens` in the context: the one rule (the
    engine's check here, the nightly's `ratchet.model.PromptRoom`)."""
    return tokens + max_new_tokens <= context


def check_room(encoded: Sequence[Sequence[int]], max_new_tokens: int, context: int | None) -> None:
    """PromptTooLong for the first encoded prompt that leaves no room for max_new_tokens (context None: no check)."""
    if context is None:
        return
    too_long = [i for i, ids in enumerate(encoded) if not fits(len(ids), max_new_tokens, context)]
    if too_long:
        i = too_long[0]
        raise PromptTooLong(i, len(encoded[i]), max_new_tokens, context, len(too_long))


@contextmanager
def naming_tasks(task_ids: Sequence[str]) -> Iterator[None]:
    """Around a generate call over prompts of these tasks (in order): a PromptTooLong names its task."""
    try:
        yield
    except PromptTooLong as e:
        if e.task_id is not None or not 0 <= e.index < len(task_ids):
            raise
        raise PromptTooLong(e.index, e.tokens, e.max_new_tokens, e.context, e.count,
                            task_ids[e.index]).with_traceback(e.__traceback__) from None


@runtime_checkable
class RolloutEngine(Protocol):
    policy_version: int

    def generate(self, prompts: list[str], n: int = 1, max_new_tokens: int = 48, temperature: float = 1.0,
                 greedy: bool = False, batch_size: int = 128, seed: int | None = None,
                 stop: Sequence[str] | None = None) -> list[Rollout]:
        """len(prompts) * n rollouts, grouped by prompt, with behaviour log-probs (module docstring)."""
        ...

    def set_policy_version(self, version: int, path: str | None = None) -> None:
        """Sample from policy `version` from now on (`path`: its checkpoint directory, for a server)."""
        ...
