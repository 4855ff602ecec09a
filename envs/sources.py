"""Imported task sets as sources of the nightly cycle, beside the generated families.

    data = read_source("data/mytasks.jsonl", store_uri)          # a path, file:// or s3:// in the store
    imp = import_source("data/mytasks.jsonl", data, EnvsConfig())
    imp.production             # a Production, as envs.production.produce makes: train, heldout, lineage
    imp.bad                    # BadLine for every line that did not import (quarantined, never dropped)
    refs = save_source(store, imp)    # the snapshot under envs/<name>/<version>/, bad_lines.jsonl beside it

`EnvsConfig.sources` names the files (`ratchet run --tasks FILE.jsonl` adds one). A source is a
task-spec JSONL (`.jsonl`, `.jsonl.gz`) or a Parquet table (`.parquet`: one task object per row,
or ratchet's own task table with a `spec_json` column; a bad row's "line" is its row number). Its name is `imported-<file stem>`
(`source_name`): the folder of its snapshot, the family of its tasks that name none, the
prefix of its task ids (`<name>/<task_id>`, so two sources cannot collide) and
`metadata["source"]` of every task, which is what evaluation groups pass rates by.

Steps, each counted in the lineage (as production counts its own):
1. import: every line through `envs.importers.parse_lines` (defaults documented there); bad
   lines are kept aside with every error and saved as `bad_lines.jsonl` beside the snapshot;
   a source with no good line is one `SourceError`;
2. split: the line's declared `split` wins, else `default_split(task_id)` (a hash: stable);
3. exact dedup and near-duplicate removal per split (the same filters as production,
   `EnvsConfig.clean`), held-out first;
4. contamination: a training task whose prompt shares >= `clean.contamination_threshold` of
   its word n-grams with the held-out split is dropped (held-out wins).
The version is `<EnvsConfig.version>-<fingerprint>`, the fingerprint hashing the file's bytes,
the cleaning settings and this code: the same file gives the same snapshot.

Curriculum: a set whose family is not registered is sampled by its declared difficulty,
easy first (`default_curriculum`).
"""

from __future__ import annotations

import decimal
import gzip
import hashlib
import inspect
import io
import json
import re
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from envs.importers import BadLine, ImportResult, parse_lines
from envs.production import Production, _Cleaner, ngrams, overlap, production_code_hash
from envs.spec import TaskSpec
from ratchet.config import EnvsConfig

SUFFIXES = (".jsonl.gz", ".jsonl", ".parquet")
PREFIX = "imported-"
MAX_ID = next(m.max_length for m in TaskSpec.model_fields["task_id"].metadata if hasattr(m, "max_length"))


class SourceError(ValueError):
    """A source that cannot be imported at all: missing, unreadable, or with no good line."""


@dataclass
class ImportedSource:
    name: str
    source: str
    production: Production
    bad: list[BadLine] = field(default_factory=list)
    dropped: list[dict] = field(default_factory=list)   # tasks the cleaning left out: task_id, split, reason


def source_suffix(source: str) -> str | None:
    return next((s for s in SUFFIXES if source.lower().endswith(s)), None)


def source_name(source: str) -> str:
    """`imported-<stem>`: one store key component (letters, digits, '._-', no '..': `envs.spec.key_part`,
    as the family of its tasks must be); a '-' in it keeps it apart from every registered family
    (a family is a Python module name)."""
    base = source.rstrip("/").rsplit("/", 1)[-1]
    suffix = source_suffix(base)
    stem = base[: -len(suffix)] if suffix else base
    return PREFIX + (re.sub(r"\.\.+", ".", re.sub(r"[^A-Za-z0-9._-]+", "-", stem)).strip(".-") or "tasks")


def check_sources(sources: Sequence[str]) -> list[str]:
    """Problems of a list of sources that need no file: a known suffix, distinct names."""
    problems, seen = [], {}
    for s in sources:
        if source_suffix(s) is None:
            problems.append(f"task source {s!r}: expected a {', '.join(SUFFIXES)} file")
        name = source_name(s)
        if name in seen:
            problems.append(f"task sources {seen[name]!r} and {s!r} would both be named {name!r}; rename one file")
        seen[name] = s
    return problems


def read_source(source: str, store_uri: str | None = None) -> bytes:
    """The bytes of a source: a local path or file:// URI; an s3:// URI inside the run's store."""
    if source.startswith("s3://"):
        from ratchet.store import open_store

        root = (store_uri or "").rstrip("/")
        if not root.startswith("s3://") or not source.startswith(root + "/"):
            raise SourceError(f"task source {source!r}: an s3:// source must lie in the run's store ({store_uri})")
        try:
            return open_store(store_uri).get_bytes(source[len(root) + 1:])
        except FileNotFoundError:
            raise SourceError(f"task source {source!r}: no such object in the store") from None
    if "://" in source and not source.startswith("file://"):
        raise SourceError(f"task source {source!r}: use a path, file:///path or an s3:// URI in the store")
    path = Path(source.removeprefix("file://")).expanduser()
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise SourceError(f"task source {source!r}: no such file") from None
    except IsADirectoryError:
        raise SourceError(f"task source {source!r}: is a directory, expected a task file") from None
    except OSError as e:
        raise SourceError(f"task source {source!r}: cannot read it: {e.strerror or e}") from None


def source_lines(source: str, data: bytes) -> list[str]:
    """One JSON object per task: the file's lines, or a Parquet table's rows (null fields left out)."""
    suffix = source_suffix(source)
    if suffix == ".parquet":
        try:
            return parquet_lines(data)
        except ValueError as e:
            raise SourceError(f"task source {source!r}: {e}") from None
    if suffix == ".jsonl.gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise SourceError(f"task source {source!r}: not a readable gzip file ({e})") from None
    if b"\x00" in data:
        raise SourceError(f"task source {source!r}: a binary file, expected JSONL text")
    try:
        return data.decode("utf-8-sig").split("\n")     # -sig: a BOM (Windows editors write one) is not line 1's
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise SourceError(f"task source {source!r}: not UTF-8 text (byte 0x{data[e.start]:02x} at line {line})") from None


def parquet_lines(data: bytes) -> list[str]:
    """A Parquet task table's rows as JSON objects: one task object per row, or ratchet's own
    table's `spec_json` (ValueError: not a readable Parquet file)."""
    import polars as pl

    try:
        table = pl.read_parquet(io.BytesIO(data))
    except Exception as e:  # noqa: BLE001 - polars raises several kinds for a bad file
        raise ValueError(f"not a readable Parquet file ({type(e).__name__})") from None
    if "spec_json" in table.columns:         # ratchet's own task table
        return [str(j) for j in table["spec_json"]]
    binary = [c for c, dtype in table.schema.items() if "Binary" in str(dtype)]
    if binary:     # json.dumps(default=str) turned b"def f" into the text "b'def f'"
        raise ValueError(f"a table with bytes (Binary) in column(s) {binary}: task fields are text, "
                         f"write them as UTF-8 strings")
    return [json.dumps(_no_nulls(row), default=_json_value) for row in table.iter_rows(named=True)]


def _json_value(value):
    """What JSON has no type for: a Decimal as the number it is (a whole one as an int, so that a
    difficulty of Decimal("2") reads as 2, not "2"), anything else (dates) as its text."""
    if isinstance(value, decimal.Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    return str(value)


def _no_nulls(value):
    """A Parquet row as the JSON object it was: a struct holds every field of its column, so the
    fields a task left out come back as nulls (a step's `entry_point` on an overwrite_file)."""
    if isinstance(value, dict):
        return {k: _no_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_no_nulls(v) for v in value]
    return value


def prefixed_id(name: str, task_id: str) -> str:
    """A source's task id: `<name>/<task_id>` (kept as it is when the line already has the prefix)."""
    return task_id if task_id.startswith(f"{name}/") else f"{name}/{task_id}"


def quarantine_long_ids(res: ImportResult, name: str, lines: list[str], source: str) -> None:
    """Move each task whose prefixed id is longer than a task id may be from `res.specs` to `res.bad`
    (model_copy does not validate: the schema's bound, checked here). `ratchet envs import` runs it too,
    so that checking a file on its own reports what `ratchet run --tasks` would quarantine."""
    fits = [len(prefixed_id(name, s.task_id)) <= MAX_ID for s in res.specs]
    res.bad += [BadLine(n, (("task_id", f"longer than {MAX_ID - len(name) - 1} characters, the most that fits "
                                        f"after the source's name {name!r}/"),), lines[n - 1], source)
                for n, ok in zip(res.lines, fits) if not ok]
    res.bad.sort(key=lambda b: b.line)
    res.specs = [s for s, ok in zip(res.specs, fits) if ok]
    res.lines = [n for n, ok in zip(res.lines, fits) if ok]


def parse_source(source: str, data: bytes) -> tuple[ImportResult, int]:
    """Every task of a source as a TaskSpec (family, id prefix and metadata["source"] set), or a
    BadLine, and how many good lines declare their split; SourceError when there is no good line."""
    name = source_name(source)
    lines = source_lines(source, data)
    res = parse_lines(lines, "taskspec", source, family=name)
    if not res.specs:
        first = res.bad[0].messages()[0] if res.bad else "the file has no task lines"
        raise SourceError(f"task source {source!r}: no good task line ({len(res.bad)} bad; first: {first})")
    quarantine_long_ids(res, name, lines, source)
    specs, kept, first_seen = [], [], {}
    for spec, n in zip(res.specs, res.lines):
        task_id = prefixed_id(name, spec.task_id)
        if task_id in first_seen:        # 'x' and '<name>/x' are distinct lines but one task once prefixed
            res.bad.append(BadLine(n, (("task_id", f"duplicate task_id {task_id!r} once prefixed with the source's "
                                        f"name (first on line {first_seen[task_id]})"),), lines[n - 1], source))
            continue
        first_seen[task_id] = n
        specs.append(spec.model_copy(update={"task_id": task_id, "metadata": {**spec.metadata, "source": name}}))
        kept.append(n)
    if not specs:
        raise SourceError(f"task source {source!r}: no good task line ({len(res.bad)} bad; first: "
                          f"{res.bad[0].messages()[0]})")
    res.bad.sort(key=lambda b: b.line)
    res.specs, res.lines = specs, kept
    declared = sum(json.loads(lines[n - 1]).get("split") is not None for n in res.lines)
    return res, declared


def _code_hash() -> str:
    import envs.importers as importers
    import envs.spec as spec

    h = hashlib.sha256(production_code_hash().encode())
    for mod in (importers, spec, sys.modules[__name__]):
        h.update(inspect.getsource(mod).encode())
    return h.hexdigest()


def import_source(source: str, data: bytes, cfg: EnvsConfig) -> ImportedSource:
    """A source as a Production: imported, split, deduplicated and decontaminated, versioned by
    the file's content, the cleaning settings and this code."""
    name, c, code = source_name(source), cfg.clean, _code_hash()
    res, declared = parse_source(source, data)
    digest = hashlib.sha256(data).hexdigest()
    fp = hashlib.sha256(json.dumps({"file": digest, "clean": c.model_dump(mode="json"), "code": code},
                                   sort_keys=True).encode()).hexdigest()[:10]
    version = f"{cfg.version}-{fp}"
    held_in = [s for s in res.specs if s.split == "heldout"]
    train_in = [s for s in res.specs if s.split == "train"]
    heldout, held_counts, held_dropped = _clean(held_in, c, "heldout")
    train, train_counts, train_dropped = _clean(train_in, c, "train", ngrams(heldout, c.ngram))
    stamp = lambda specs: [s.model_copy(update={"version": version}) for s in specs]  # noqa: E731
    lineage = {
        "family": name, "version": version, "source": source, "source_sha256": digest, "format": source_suffix(source),
        "code_sha256": code, "clean_config": c.model_dump(mode="json"),
        "counts": {"lines_ok": len(res.specs), "lines_bad": len(res.bad), "split_declared": declared,
                   "train": train_counts, "heldout": held_counts},
        "bad_lines": "bad_lines.jsonl" if res.bad else None,
        "dropped": "dropped.jsonl" if held_dropped or train_dropped else None,
    }
    return ImportedSource(name, source, Production(name, version, stamp(train), stamp(heldout), lineage), res.bad,
                          held_dropped + train_dropped)


def _clean(specs: list[TaskSpec], c, split: str,
           heldout_grams: set[str] | None = None) -> tuple[list[TaskSpec], dict, list[dict]]:
    """The specs that survive exact / near dedup (and, for training, the contamination check), the
    counts, and each one left out: {task_id, split, reason}."""
    cleaner, kept, dropped = _Cleaner(c, split), [], []
    for s in specs:
        shared = overlap(s.prompt, heldout_grams, c.ngram) if heldout_grams is not None else 0.0
        exact = cleaner.exact
        if heldout_grams is not None and shared >= c.contamination_threshold:
            reason = f"contaminated: {shared:.0%} of its prompt's {c.ngram}-word sequences are in held-out prompts"
        elif cleaner.admit(s):
            kept.append(s)
            continue
        else:
            reason = f"{'exact' if cleaner.exact > exact else 'near'} duplicate of an earlier {split} prompt"
        dropped.append({"task_id": s.task_id, "split": split, "reason": reason})
    counts = {"imported": len(specs), "exact_duplicates": cleaner.exact, "near_duplicates": cleaner.near,
              "kept": len(kept)}
    if heldout_grams is not None:
        counts["contaminated"] = sum(d["reason"].startswith("contaminated") for d in dropped)
    return kept, counts, dropped


def save_source(st, imp: ImportedSource) -> dict:
    """The snapshot (as `save_production` writes a family's) and, beside it, the bad lines with
    every error (`bad_lines.jsonl`) and the good tasks the cleaning left out with why (`dropped.jsonl`),
    one JSON object a line. Refs: train, heldout, lineage, bad_lines, dropped (None when empty)."""
    from envs.snapshot import prefix, save_production

    refs = save_production(st, imp.production)
    bad = [{"source": b.source, "line": b.line, "errors": [{"field": f, "error": e} for f, e in b.errors],
            "message": b.message(), "raw": b.raw} for b in imp.bad]
    for name, rows in (("bad_lines", bad), ("dropped", imp.dropped)):
        key = f"{prefix(imp.name, imp.production.version)}/{name}.jsonl"
        body = "".join(json.dumps(r) + "\n" for r in rows).encode()
        refs[name] = None if not rows else st.ref(key) if st.exists(key) else st.put_bytes(key, body)
    return refs


def default_curriculum(step: int, total: int, max_difficulty: int) -> list[float]:
    """Weights per difficulty 1..max for a set with no curriculum of its own: the favoured level
    moves from 1 (first wave) to max (last), each level weighted 1 / (1 + its distance from it)."""
    target = 1 + (max_difficulty - 1) * step / max(total - 1, 1)
    return [1.0 / (1.0 + abs(d - target)) for d in range(1, max_difficulty + 1)]


def curriculum_for(family: str) -> Callable[[int, int, int], list[float]] | None:
    """A registered family's curriculum; an imported set's: by declared difficulty."""
    from envs.registry import get_family

    try:
        return get_family(family).curriculum
    except KeyError:
        return default_curriculum


def interleave(groups: Sequence[Sequence[TaskSpec]]) -> list[TaskSpec]:
    """Round robin over the groups, so that the first n of the result share n fairly among them
    (held-out tasks of a family and of an imported set, cut to `eval.n_tasks`)."""
    longest = max((len(g) for g in groups), default=0)
    return [g[i] for i in range(longest) for g in groups if i < len(g)]
