"""ratchet: RL post-training for LLMs (see DESIGN.md for the layer map).

Importing ratchet pins torch's CPU numerics to one code path (AVX2) unless the environment
chooses otherwise, so that one config and seed train the same weights on every x86 machine of
a kind: torch picks its vectorised kernels by the CPU's instruction set (AVX-512 here, AVX2 on
a machine without it), and the kernels round differently — five AdamW steps of a tiny model
end in different bits, and ninety waves of RL in different held-out figures. It must happen
before torch is imported; `numerics_pinned()` says whether it did.
"""

import os
import sys

PINNED_NUMERICS = {
    "ATEN_CPU_CAPABILITY": "avx2",   # torch's own vectorised CPU kernels
    "MKL_CBWR": "AVX2",              # MKL's conditional numerical reproducibility (GEMM)
    "ONEDNN_MAX_CPU_ISA": "AVX2",    # oneDNN (convolutions, some matmuls)
}

if "torch" not in sys.modules:
    for _name, _value in PINNED_NUMERICS.items():
        os.environ.setdefault(_name, _value)


def numerics_pinned() -> bool:
    """True when torch runs the pinned CPU code path (or the one the environment asked for)."""
    import torch

    want = os.environ.get("ATEN_CPU_CAPABILITY", "").upper()
    return bool(want) and torch.backends.cpu.get_cpu_capability() == ("DEFAULT" if want == "DEFAULT" else want)
