"""The Llama decode's generated-token buffers, pooled between batches on CPU (ratchet/rollout/decoders.py)."""

import torch

from ratchet.rollout import decoders
from tests.rollout.test_torch_engine import PROMPTS, _engine, _full_forward_logprobs


def test_workspace_hands_a_buffer_set_out_once_and_takes_it_back():
    ws, like = decoders._Workspace(), torch.zeros(1)
    first = ws.take(4, (2, 3, 5, 8), like)
    other = ws.take(4, (2, 3, 5, 8), like)               # the first set is in use: a fresh one
    assert not any(a.data_ptr() == b.data_ptr() for a in first for b in other)
    ws.give(first)
    again = ws.take(4, (2, 3, 5, 8), like)
    assert [t.data_ptr() for t in again] == [t.data_ptr() for t in first]
    assert ws.take(4, (2, 3, 5, 8), like)[0].data_ptr() != first[0].data_ptr()   # taken out: not handed twice
    ws.give(again)
    assert ws.take(4, (2, 4, 5, 8), like)[0].data_ptr() != first[0].data_ptr()   # another shape: not reused
    small = decoders._Workspace()
    small.MAX_BYTES = 10
    small.give(again)                                    # too big to keep
    assert small._free is None


def test_reused_buffers_full_of_garbage_change_nothing(monkeypatch):
    """A batch decodes on the previous batch's buffers; poisoned with NaN, the log-probs still equal a
    full forward's (nothing left over is ever read)."""
    ws = decoders._Workspace()
    monkeypatch.setattr(decoders, "_WORKSPACE", ws)
    engine, model = _engine()
    engine.generate(PROMPTS, n=2, max_new_tokens=8, batch_size=6, seed=0)    # leaves its buffers in the pool
    assert ws._free is not None
    with torch.inference_mode():                         # the engine's buffers are inference tensors
        for buf in ws._free[1]:
            buf.fill_(float("nan"))
    out = engine.generate(PROMPTS, n=2, max_new_tokens=8, batch_size=6, seed=1)
    for r in out:
        torch.testing.assert_close(torch.tensor(r.logprobs), _full_forward_logprobs(model, r), atol=1e-4, rtol=1e-4)
