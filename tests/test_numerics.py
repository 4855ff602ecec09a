"""The CPU code path is pinned, so a config and seed train the same bits on every x86 machine:
torch's kernels differ by instruction set (AVX-512 vs AVX2 round differently), and the training
forward must not depend on the thread count or load. Each check runs in a fresh interpreter,
where the import order is the user's."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN = """
import hashlib, sys, ratchet, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
m = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2))
x = torch.randint(0, 128, (4, 24))
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
for _ in range(3):
    m(input_ids=x, labels=x).loss.backward(); opt.step(); opt.zero_grad()
print(torch.backends.cpu.get_cpu_capability(), ratchet.numerics_pinned(),
      hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in m.parameters())).hexdigest())
"""

# the trainer's prompt-shared layout: each prompt's KV is forwarded once and shared by its group's
# rows, so the backward sums each prompt's gradient over its rows; at these sizes the sum's order
# once depended on the thread count (advanced indexing's backward), and one config and seed
# trained different weights on 1 and 2 threads
SHARED = """
import hashlib, ratchet, torch
from transformers import LlamaConfig, LlamaForCausalLM
from ratchet.train.policy import PolicyWithValue
torch.manual_seed(0)
m = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=192, intermediate_size=256, num_hidden_layers=1,
                                 num_attention_heads=6, num_key_value_heads=6))
for U, N, P, C in [(8, 58, 34, 16), (16, 128, 30, 20)]:
    prompts = torch.randint(1, 128, (U, P))
    index = torch.sort(torch.randint(0, U, (N,))).values
    comp = torch.randint(1, 128, (N, C))
    logits, _ = PolicyWithValue(m, None)(prompts, torch.ones_like(prompts), shared=(index, comp, torch.ones_like(comp)))
    (logits * torch.randn(logits.shape)).sum().backward()
print(hashlib.sha256(b"".join(p.grad.numpy().tobytes() for p in m.parameters())).hexdigest())
"""


def _train(script: str = TRAIN, **env) -> list[str]:
    clean = {k: v for k, v in __import__("os").environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**clean, **env}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the pinned code path is x86's AVX2")
def test_importing_ratchet_pins_the_cpu_code_path_and_threads_do_not_change_the_bits():
    one = _train(OMP_NUM_THREADS="1")
    two = _train(OMP_NUM_THREADS="2")
    assert one[:2] == ["AVX2", "True"] and two[:2] == ["AVX2", "True"]
    assert one[2] == two[2]


def test_the_trainers_shared_prompt_gradient_does_not_depend_on_the_thread_count():
    assert _train(SHARED, OMP_NUM_THREADS="1") == _train(SHARED, OMP_NUM_THREADS="2")


def test_the_environment_can_choose_another_code_path():
    got = _train(ATEN_CPU_CAPABILITY="default")
    assert got[:2] == ["DEFAULT", "True"]
