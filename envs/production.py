"""Environment production: generate a family's tasks, clean them, split them, record lineage.

    prod = produce("python_functions", EnvsConfig())
    prod.train, prod.heldout          # lists of TaskSpec
    prod.version                      # "<cfg.version>-<fingerprint>", the snapshot's name
    prod.lineage                      # code hash, configs, seed, counts removed at each step

Steps, each counted in the lineage:

1. generate: `n` tasks per split spread evenly over difficulties 1..max_difficulty, task i of
   a difficulty from the family's deterministic `generate(cfg, seed, i, difficulty, split)`;
   generation keeps drawing indices (up to `attempts` x the quota) while dedup removes tasks,
   and a difficulty that runs out of distinct tasks hands its shortfall to the next one;
2. exact dedup: the sha256 of the normalised prompt (case-folded, whitespace collapsed);
3. near-duplicate removal: MinHash LSH (datasketch) over word shingles of the prompt;
4. contamination: a training task whose prompt shares >= `contamination_threshold` of its word
   n-grams with the held-out split is dropped (held-out is generated first and wins); the
   training split keeps drawing until it is full again.

Everything is a pure function of (family code, generator config, EnvsConfig): the version's
fingerprint hashes exactly those, so the same inputs give the same snapshot.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from dataclasses import dataclass, field
from typing import Iterable

from pydantic import BaseModel

from envs.registry import get_family
from envs.spec import TaskSpec
from ratchet.config import CleanConfig, EnvsConfig


@dataclass
class Production:
    family: str
    version: str
    train: list[TaskSpec]
    heldout: list[TaskSpec]
    lineage: dict = field(default_factory=dict)


def normalise(text: str) -> str:
    return " ".join(text.casefold().split())


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", normalise(text))


def shingles(text: str, k: int) -> set[str]:
    """Word k-grams; a text shorter than k words is one shingle (itself)."""
    w = _words(text)
    if len(w) <= k:
        return {" ".join(w)}
    return {" ".join(w[i:i + k]) for i in range(len(w) - k + 1)}


def family_code_hash(family: str) -> str:
    """sha256 of the family's source file and of the spec schema it builds."""
    import envs.spec as spec_mod
    fam = get_family(family)
    h = hashlib.sha256()
    for obj in (inspect.getmodule(fam.generate), spec_mod):
        h.update(inspect.getsource(obj).encode())
    return h.hexdigest()


class _Cleaner:
    """Streaming exact + near-duplicate filter over prompts."""

    def __init__(self, c: CleanConfig, salt: str):
        from datasketch import MinHash, MinHashLSH
        self.c, self.salt, self._mh = c, salt, MinHash
        self.seen: set[str] = set()
        # recall-weighted bands, then each candidate confirmed by its estimated Jaccard
        self.lsh = MinHashLSH(threshold=c.near_dup_threshold, num_perm=c.num_perm, weights=(0.1, 0.9))
        self.sketches: dict[str, object] = {}
        self.exact = self.near = 0

    def admit(self, spec: TaskSpec) -> bool:
        key = hashlib.sha256(normalise(spec.prompt).encode()).hexdigest()
        if key in self.seen:
            self.exact += 1
            return False
        self.seen.add(key)
        m = self._mh(num_perm=self.c.num_perm, seed=1)
        m.update_batch([s.encode() for s in shingles(spec.prompt, self.c.shingle)])
        if any(self.sketches[k].jaccard(m) >= self.c.near_dup_threshold for k in self.lsh.query(m)):
            self.near += 1
            return False
        key = f"{self.salt}:{len(self.seen)}"
        self.lsh.insert(key, m)
        self.sketches[key] = m
        return True


def _generate(family: str, gen_cfg: BaseModel, cfg: EnvsConfig, split: str, n: int, c: CleanConfig,
              heldout_grams: set[str] | None = None) -> tuple[list[TaskSpec], dict]:
    """n clean tasks of one split; a training task that overlaps `heldout_grams` is dropped."""
    fam = get_family(family)
    levels = list(range(1, cfg.max_difficulty + 1))
    quota = {d: n // len(levels) + (1 if i < n % len(levels) else 0) for i, d in enumerate(levels)}
    cleaner = _Cleaner(c, split)
    kept: list[TaskSpec] = []
    counts = {"generated": 0, "per_difficulty": {}, "contaminated": 0}
    carry = 0
    for d in levels:
        want, got, index = quota[d] + carry, 0, 0
        while got < want and index < c.attempts * max(want, 1):
            spec = fam.generate(gen_cfg, cfg.seed, index, d, split)
            index += 1
            if heldout_grams is not None and overlap(spec.prompt, heldout_grams, c.ngram) >= c.contamination_threshold:
                counts["contaminated"] += 1
            elif cleaner.admit(spec):
                kept.append(spec)
                got += 1
        counts["generated"] += index
        counts["per_difficulty"][str(d)] = got
        carry = want - got
    counts.update(exact_duplicates=cleaner.exact, near_duplicates=cleaner.near, shortfall=carry, kept=len(kept))
    return kept, counts


def ngrams(specs: Iterable[TaskSpec], k: int) -> set[str]:
    """Word k-grams of the prompts (a prompt shorter than k words counts whole)."""
    grams: set[str] = set()
    for s in specs:
        grams |= shingles(s.prompt, k)
    return grams


def overlap(prompt: str, grams: set[str], k: int) -> float:
    """Share of the prompt's word k-grams found in `grams`."""
    mine = shingles(prompt, k)
    return sum(g in grams for g in mine) / len(mine)


def contaminated(train: Iterable[TaskSpec], heldout: Iterable[TaskSpec], k: int, threshold: float) -> list[bool]:
    """Per training task: does it share >= threshold of its word k-grams with the held-out split?"""
    grams = ngrams(heldout, k)
    return [overlap(s.prompt, grams, k) >= threshold for s in train]


def production_code_hash() -> str:
    """sha256 of this module: a change to how tasks are cleaned makes a new version too."""
    import sys
    return hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()


def fingerprint(family: str, gen_cfg: BaseModel, cfg: EnvsConfig, c: CleanConfig) -> str:
    blob = json.dumps({"code": family_code_hash(family), "production": production_code_hash(),
                       "generator": gen_cfg.model_dump(mode="json"),
                       "envs": cfg.model_dump(mode="json", exclude={"families", "family_config", "clean", "sources"}),
                       "clean": c.model_dump(mode="json")}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def produce(family: str, cfg: EnvsConfig) -> Production:
    """Generate, dedup, decontaminate and version one family's train and held-out tasks
    (generator settings: `cfg.family_config[family]`; filters: `cfg.clean`)."""
    gen_cfg = cfg.generator_config(family)
    c = cfg.clean
    version = f"{cfg.version}-{fingerprint(family, gen_cfg, cfg, c)}"
    heldout, held_counts = _generate(family, gen_cfg, cfg, "heldout", cfg.n_heldout, c)
    del held_counts["contaminated"]   # held-out wins: only training tasks are checked against it
    train, train_counts = _generate(family, gen_cfg, cfg, "train", cfg.n_train, c, ngrams(heldout, c.ngram))
    stamp = lambda specs: [s.model_copy(update={"version": version}) for s in specs]  # noqa: E731
    lineage = {
        "family": family, "version": version, "family_code_sha256": family_code_hash(family),
        "production_code_sha256": production_code_hash(),
        "generator_config": gen_cfg.model_dump(mode="json"), "envs_config": cfg.model_dump(mode="json", exclude={"family_config", "clean", "sources"}),
        "clean_config": c.model_dump(mode="json"), "seed": cfg.seed,
        "counts": {"train": train_counts, "heldout": held_counts},
    }
    return Production(family, version, stamp(train), stamp(heldout), lineage)
