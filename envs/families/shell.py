"""shell: reach a target filesystem state with a POSIX shell script.

    Starting files: data/a.log, data/b.txt, notes.txt
    1. Create the directory 'out'.
    2. Move 'data/a.log' to 'out/a.log'.
    3. Write the number of .txt files directly inside 'data' to 'count.txt'.

The completion is written to solution.sh and judged by one check_calls call: `observe(files,
absent, dirs)` (check.py, the `CHECK` below) runs it with /bin/sh in the task's directory, then
returns the state of the paths it is given (each expected file's content, trailing newlines
ignored; whether each removed path still exists; whether each directory is one). The verifier
compares that state with the expected one outside the sandbox, so the expected state never
enters it: a script cannot read the answer off a hidden file. Difficulty = number of steps
(1..5); the expected state comes from simulating the steps here, never from running a script.
"""

from __future__ import annotations

import hashlib
import json
import random

from pydantic import BaseModel, ConfigDict, Field

from envs.registry import register_family
from envs.spec import COMPLETION, CallTest, CheckCalls, OverwriteFile, TaskSpec

CHECK = '''import os, subprocess


def observe(files, absent, dirs):
    """Run solution.sh, then report (never judge) the state of the given paths."""
    subprocess.run(["/bin/sh", "solution.sh"], timeout=TIMEOUT_, stdin=subprocess.DEVNULL, stdout=2)

    def content(path):
        try:
            with open(path, errors="replace") as f:
                return f.read().rstrip("\\n")
        except OSError:
            return None
    return ([[p, content(p)] for p in files] + [[p, os.path.lexists(p)] for p in absent]
            + [[d, os.path.isdir(d)] for d in dirs])
'''
"""check.py: the entry point `observe` of the task's one check_calls call. It knows which paths to look
at (the call's args), not what they should hold: the expected state stays in `TaskSpec.tests`."""

_WORDS = ("alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma")
_EXTS = ("txt", "log", "csv")


class Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    start_files: int = Field(4, ge=2, le=20, description="Files in the starting snapshot.")
    script_timeout_s: float = Field(3.0, gt=0, le=60, description="Time the acceptance script gives solution.sh.")
    heldout_fraction: float = Field(0.15, gt=0, lt=1, description="Share of tasks (by their step list) reserved for held-out.")


def _start(rng: random.Random, n: int) -> dict[str, str]:
    files = {}
    while len(files) < n:
        d = rng.choice(("data", "data", "logs", ""))
        name = f"{rng.choice(_WORDS)}.{rng.choice(_EXTS)}"
        files[f"{d}/{name}" if d else name] = f"{rng.choice(_WORDS)} {rng.randint(1, 99)}\n"
    return files


def _step(rng: random.Random, fs: dict[str, str], dirs: set[str]) -> tuple[str, str]:
    """Apply one random step to (fs, dirs); return (instruction, shell line)."""
    kind = rng.choice(("mkdir", "write", "copy", "move", "delete", "count", "append"))
    files = sorted(fs)
    src = rng.choice(files) if files else None
    if kind == "mkdir" or src is None:
        d = f"{rng.choice(('out', 'archive', 'backup'))}{rng.randint(1, 9)}"
        dirs.add(d)
        return f"Create the directory '{d}'.", f"mkdir -p {d}"
    if kind == "write":
        path, text = f"{rng.choice(_WORDS)}{rng.randint(1, 9)}.txt", f"{rng.choice(_WORDS)} {rng.randint(100, 999)}"
        fs[path] = text + "\n"
        return f"Create the file '{path}' containing the line '{text}'.", f"echo '{text}' > {path}"
    if kind in ("copy", "move"):
        d = f"{rng.choice(('out', 'archive', 'backup'))}{rng.randint(1, 9)}"
        dst = f"{d}/{src.rsplit('/', 1)[-1]}"
        dirs.add(d)
        fs[dst] = fs[src]
        if kind == "move":
            del fs[src]
            return f"Move '{src}' to '{dst}' (create '{d}' if needed).", f"mkdir -p {d} && mv {src} {dst}"
        return f"Copy '{src}' to '{dst}' (create '{d}' if needed).", f"mkdir -p {d} && cp {src} {dst}"
    if kind == "delete":
        del fs[src]
        return f"Delete '{src}'.", f"rm -f {src}"
    if kind == "append":
        text = f"{rng.choice(_WORDS)} {rng.randint(100, 999)}"
        fs[src] = fs[src] + text + "\n"
        return f"Append the line '{text}' to '{src}'.", f"echo '{text}' >> {src}"
    top = sorted({p.rsplit(".", 1)[-1] for p in fs if "/" not in p and "." in p} & set(_EXTS))
    if not top:   # nothing to count (a zero count is too easy to get right by accident)
        return _step(rng, fs, dirs)
    ext = rng.choice(top)
    n = sum(1 for p in fs if p.endswith("." + ext) and "/" not in p)
    out = f"count_{ext}.txt"
    fs[out] = f"{n}\n"
    return (f"Write the number of .{ext} files in the top directory (before this step) to '{out}'.",
            f"n=$(ls -1 | grep -c '\\.{ext}$'); echo $n > {out}")


def _reserved(key: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(f"shell/heldout/{key}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def generate(cfg: Config, seed: int, index: int, difficulty: int, split: str) -> TaskSpec:
    rng = random.Random(f"shell:{seed}:{split}:{difficulty}:{index}")
    while True:
        start = _start(rng, cfg.start_files)
        fs, dirs, steps, lines = dict(start), set(), [], []
        for _ in range(difficulty):
            what, line = _step(rng, fs, dirs)
            steps.append(what)
            lines.append(line)
        if fs != start and _reserved("|".join(steps), cfg.heldout_fraction) == (split == "heldout"):
            break
    listing = ", ".join(sorted(start))
    prompt = ("Write a POSIX shell script, run with /bin/sh in the task's directory, that does the following.\n"
              f"Starting files: {listing}\n" + "".join(f"{i}. {s}\n" for i, s in enumerate(steps, 1)))
    files, absent, dirs = sorted(fs), sorted(set(start) - set(fs)), sorted(dirs)
    state = [[f, fs[f].rstrip("\n")] for f in files] + [[a, False] for a in absent] + [[d, True] for d in dirs]
    check = CHECK.replace("TIMEOUT_", repr(cfg.script_timeout_s))
    digest = hashlib.sha256(f"{prompt}|{seed}|{index}".encode()).hexdigest()[:12]
    return TaskSpec(
        task_id=f"sh-{split}-{difficulty}-{digest}", family="shell", difficulty=difficulty, split=split,
        prompt=prompt,
        execution_steps=(OverwriteFile(path="/app/solution.sh", content=COMPLETION),
                         OverwriteFile(path="/app/check.py", content=check), CheckCalls(entry_point="observe")),
        files=start, tests=(CallTest(args=json.dumps([files, absent, dirs]), expected=json.dumps(state)),),
        reference_solution="".join(line + "\n" for line in lines),
        metadata={"steps": len(steps)},
    )


def trivial_answers(spec: TaskSpec) -> list[str]:
    return ["", ":\n", "exit 0\n", "ls\n", "rm -rf ./*\n"]


def curriculum(step: int, total: int, max_difficulty: int) -> list[float]:
    """Start on one-step scripts; by the end every length is equally likely."""
    t = step / max(total - 1, 1)
    return [1.0 if d == 1 else t for d in range(1, max_difficulty + 1)] if t > 0 else [1.0] + [0.0] * (max_difficulty - 1)


register_family("shell", config=Config, generate=generate, trivial_answers=trivial_answers, curriculum=curriculum)
