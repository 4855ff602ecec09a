"""An imported task set as a source: split, dedup, contamination, versioning, bad lines, curriculum.

    .venv/bin/python -m pytest tests/envs/test_sources.py -q
"""

from __future__ import annotations

import gzip
import json

import polars as pl
import pytest
from pydantic import ValidationError

from envs.importers import default_split
from envs.sources import (SourceError, check_sources, curriculum_for, default_curriculum, import_source, interleave,
                          parse_source, read_source, save_source, source_name)
from ratchet.config import CleanConfig, EnvsConfig
from ratchet.eval.report import pass_rates_by_source
from ratchet.data.schemas import tasks_frame
from ratchet.store import open_store

LONG = ("Write a function f that takes a list of integers and returns the sum of the even values, "
        "ignoring negative numbers, and returns zero for an empty list; keep it short and readable please")


def task(task_id: str, prompt: str, **kw) -> dict:
    return {"task_id": task_id, "prompt": prompt, "reference_solution": "    return x + 1\n",
            "execution_steps": [{"action": "overwrite_file", "path": "/app/solution.py",
                                 "content": "def f(x):\n<model_generated_code>"},
                                {"action": "check_calls", "entry_point": "f"}],
            "tests": [{"args": "[1]", "expected": "2"}], **kw}


def jsonl(*objs) -> bytes:
    return "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs).encode()


def test_names_ids_family_and_metadata():
    assert source_name("/data/My Tasks.jsonl.gz") == "imported-My-Tasks"
    assert source_name("s3://b/p/imports/set.v2.parquet") == "imported-set.v2"
    imp = import_source("/x/mine.jsonl", jsonl(task("a", "def f(x): add one", split="train"),
                                               task("b", "def f(x): add two", split="train", family="handmade")),
                        EnvsConfig())
    a, b = imp.production.train
    assert (a.task_id, a.family, a.metadata["source"]) == ("imported-mine/a", "imported-mine", "imported-mine")
    assert (b.task_id, b.family, b.metadata["source"]) == ("imported-mine/b", "handmade", "imported-mine")
    assert a.version == imp.production.version == imp.production.lineage["version"]


def test_a_declared_split_wins_else_the_hash_of_the_task_id():
    ids = [f"t{i}" for i in range(40)]
    held = [i for i in ids if default_split(i) == "heldout"]
    assert held and len(held) < len(ids)           # the hash sends some of these ids each way
    objs = [task(i, f"task number {i} of the set") for i in ids] + [task("pinned", "a pinned one", split="heldout")]
    imp = import_source("s.jsonl", jsonl(*objs), EnvsConfig())
    got = {s.task_id.split("/", 1)[1] for s in imp.production.heldout}
    assert got == set(held) | {"pinned"}
    assert imp.production.lineage["counts"]["split_declared"] == 1
    again = import_source("s.jsonl", jsonl(*reversed(objs)), EnvsConfig())    # file order does not matter
    assert {s.task_id for s in again.production.heldout} == {s.task_id for s in imp.production.heldout}


def test_exact_and_near_duplicates_are_removed_per_split():
    imp = import_source("s.jsonl", jsonl(
        task("a", LONG, split="train"),
        task("b", "  " + LONG.upper() + " ", split="train"),             # exact, once normalised
        task("c", LONG.replace("please", "thanks"), split="train"),       # near: the last word differs
        task("d", "something else entirely, about strings", split="train"),
        task("e", LONG, split="heldout"), task("f", LONG, split="heldout"),
    ), EnvsConfig())
    counts = imp.production.lineage["counts"]
    assert [s.task_id for s in imp.production.heldout] == ["imported-s/e"]
    assert counts["heldout"] == {"imported": 2, "exact_duplicates": 1, "near_duplicates": 0, "kept": 1}
    # a, b, c share the held-out prompt: contaminated before dedup sees them; d is kept
    assert [s.task_id for s in imp.production.train] == ["imported-s/d"]
    assert counts["train"] == {"imported": 4, "exact_duplicates": 0, "near_duplicates": 0, "kept": 1, "contaminated": 3}

    no_heldout = import_source("s.jsonl", jsonl(*[task(i, p, split="train") for i, p in (
        ("a", LONG), ("b", LONG.upper()), ("c", LONG.replace("please", "thanks")))]), EnvsConfig())
    assert no_heldout.production.lineage["counts"]["train"] == {
        "imported": 3, "exact_duplicates": 1, "near_duplicates": 1, "kept": 1, "contaminated": 0}


def test_contamination_drops_training_tasks_that_overlap_the_heldout_split():
    held = "Reverse the words of a sentence while keeping punctuation attached to the word it follows in the text"
    imp = import_source("s.jsonl", jsonl(
        task("h", held, split="heldout"),
        task("copy", held + " and nothing else", split="train"),          # 13-grams mostly shared
        task("other", "Count the vowels of a string, case-insensitively, and return the count", split="train"),
    ), EnvsConfig(clean=CleanConfig(ngram=13, contamination_threshold=0.5)))
    assert [s.task_id for s in imp.production.train] == ["imported-s/other"]
    assert imp.production.lineage["counts"]["train"]["contaminated"] == 1
    lenient = import_source("s.jsonl", jsonl(task("h", held, split="heldout"), task("copy", held + " and nothing else",
                                                                                   split="train")),
                            EnvsConfig(clean=CleanConfig(contamination_threshold=1.0)))
    assert len(lenient.production.train) == 1        # 3 of 4 13-grams shared: under a threshold of 1.0


def test_version_is_the_content_and_the_cleaning_settings():
    data = jsonl(task("a", "def f(x): add one"))
    v = import_source("a.jsonl", data, EnvsConfig()).production.version
    assert v == import_source("elsewhere/a.jsonl", data, EnvsConfig()).production.version
    assert v.startswith("v1-") and v != import_source("a.jsonl", data + b"\n", EnvsConfig()).production.version
    assert v != import_source("a.jsonl", data, EnvsConfig(clean=CleanConfig(ngram=5))).production.version
    assert import_source("a.jsonl", data, EnvsConfig(version="v2")).production.version.startswith("v2-")


def test_bad_lines_are_quarantined_beside_the_snapshot(tmp_path):
    src = tmp_path / "mixed.jsonl"
    src.write_bytes(jsonl(task("a", "def f(x): add one", split="train"), "not json",
                          task("b", "def f(x): add two", split="heldout", difficulty=9)))
    imp = import_source(str(src), read_source(str(src)), EnvsConfig())
    assert [b.line for b in imp.bad] == [2, 3]
    st = open_store(str(tmp_path / "store"))
    refs = save_source(st, imp)
    assert refs["train"].rows == 1 and refs["heldout"].rows == 0
    rows = [json.loads(ln) for ln in st.get_bytes(refs["bad_lines"]).decode().splitlines()]
    assert [(r["line"], r["errors"][0]["field"]) for r in rows] == [(2, "(json)"), (3, "difficulty")]
    assert rows[1]["message"].startswith(f"{src}:3: field 'difficulty'")
    assert imp.production.lineage["counts"]["lines_bad"] == 2 and imp.production.lineage["bad_lines"] == "bad_lines.jsonl"
    assert st.get_json(refs["lineage"])["source_sha256"] == imp.production.lineage["source_sha256"]
    long_id = import_source("s.jsonl", jsonl(task("b" * 256, "x y z"), task("ok", "x y")), EnvsConfig())
    (bad,) = long_id.bad                             # fits the schema, not once prefixed with "imported-s/"
    assert bad.line == 1 and bad.field == "task_id" and "longer than 245 characters" in bad.error
    clean = import_source("c.jsonl", jsonl(task("a", "x y")), EnvsConfig())
    assert save_source(st, clean)["bad_lines"] is None


def test_ids_that_collide_once_prefixed_and_bad_families_are_bad_lines():
    """'x' and 'imported-dup/x' are one task once prefixed: the second is quarantined naming the first
    (not left to fail the gate's task_id_unique); a line's own family must name a store folder."""
    imp = import_source("dup.jsonl", jsonl(task("x", "add one to an integer", split="train"),
                                           task("imported-dup/x", "the successor of a number", split="train"),
                                           task("y", "sort a list in reverse", family="has space/x"),
                                           task("z", "reverse a string", split="train")), EnvsConfig())
    assert [s.task_id for s in imp.production.train] == ["imported-dup/x", "imported-dup/z"]
    assert [m for b in imp.bad for m in b.messages()] == [
        "dup.jsonl:2: field 'task_id': duplicate task_id 'imported-dup/x' once prefixed with the source's name "
        "(first on line 1)",
        "dup.jsonl:3: field 'family': 'has space/x' cannot name a store folder: letters, digits and '._-' only"]
    assert source_name("a..b.jsonl") == "imported-a.b"       # the source's name is a family too


def test_a_source_with_no_good_line_is_one_clear_error(tmp_path):
    with pytest.raises(SourceError, match=r"'t.jsonl': no good task line \(2 bad; first: t.jsonl:1: field '\(json\)'"):
        import_source("t.jsonl", b"nope\n[1]\n", EnvsConfig())
    with pytest.raises(SourceError, match="no good task line .0 bad; first: the file has no task lines"):
        import_source("t.jsonl", b"\n\n", EnvsConfig())


def test_unreadable_sources_say_why(tmp_path):
    (tmp_path / "bin.jsonl").write_bytes(b"\x7fELF\x00")
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 nope")
    (tmp_path / "l1.jsonl").write_bytes(b'{"a": "caf\xe9"}\n')
    cases = {str(tmp_path / "missing.jsonl"): "no such file", str(tmp_path): "is a directory",
             "ftp://h/x.jsonl": "use a path", "s3://other/x.jsonl": "must lie in the run's store"}
    for source, needle in cases.items():
        with pytest.raises(SourceError, match=needle):
            read_source(source, store_uri="s3://bucket/prefix")
    for name, needle in {"bin.jsonl": "binary file", "bad.jsonl.gz": "not a readable gzip file",
                         "bad.parquet": "not a readable Parquet file", "l1.jsonl": "byte 0xe9 at line 1"}.items():
        path = str(tmp_path / name)
        with pytest.raises(SourceError, match=needle):
            parse_source(path, read_source(path))


def test_a_byte_order_mark_is_not_part_of_line_one():
    """Found by review: a BOM (Windows editors write one) made line 1 malformed JSON."""
    objs = [task("a", "def f(x): add one", split="train"), task("b", "def f(x): add two", split="train")]
    for source, data in (("s.jsonl", b"\xef\xbb\xbf" + jsonl(*objs)), ("s.jsonl.gz", gzip.compress(b"\xef\xbb\xbf" + jsonl(*objs)))):
        res, _ = parse_source(source, data)
        assert res.bad == [] and [s.task_id for s in res.specs] == ["imported-s/a", "imported-s/b"], source


def test_gzip_and_parquet_sources_import_the_same_tasks(tmp_path):
    objs = [task("a", "def f(x): add one", split="train", difficulty=2), task("b", "def f(x): add two", split="heldout")]
    plain = import_source("s.jsonl", jsonl(*objs), EnvsConfig())
    gz = import_source("s.jsonl.gz", gzip.compress(jsonl(*objs)), EnvsConfig())
    pl.DataFrame(objs).write_parquet(tmp_path / "s.parquet")      # one task object per row, nested as structs
    pq = import_source("s.parquet", (tmp_path / "s.parquet").read_bytes(), EnvsConfig())
    # ratchet's own task table (spec_json) is a source too
    pl.concat([tasks_frame(plain.production.train), tasks_frame(plain.production.heldout)]).write_parquet(tmp_path / "t.parquet")
    table = import_source("s.parquet", (tmp_path / "t.parquet").read_bytes(), EnvsConfig())
    for other in (gz, pq, table):
        assert [(s.task_id, s.difficulty, s.prompt, s.tests) for s in other.production.train + other.production.heldout] \
            == [(s.task_id, s.difficulty, s.prompt, s.tests) for s in plain.production.train + plain.production.heldout]


def test_sources_in_the_config():
    assert EnvsConfig(sources=("a.jsonl", "b.parquet")).sources == ("a.jsonl", "b.parquet")
    assert check_sources(["x/a.jsonl", "y/a.jsonl.gz"]) == [
        "task sources 'x/a.jsonl' and 'y/a.jsonl.gz' would both be named 'imported-a'; rename one file"]
    with pytest.raises(ValidationError, match=r"task source 'a.csv': expected a .jsonl.gz, .jsonl, .parquet file"):
        EnvsConfig(sources=("a.csv",))


def test_default_curriculum_moves_from_easy_to_hard():
    # target difficulty 1 -> 2 -> 3 over three waves; weight 1 / (1 + distance), by hand
    assert default_curriculum(0, 3, 3) == [1.0, 0.5, 1 / 3]
    assert default_curriculum(1, 3, 3) == [0.5, 1.0, 0.5]
    assert default_curriculum(2, 3, 3) == [1 / 3, 0.5, 1.0]
    assert default_curriculum(0, 1, 1) == [1.0]
    assert curriculum_for("imported-mine") is default_curriculum
    from envs.families.python_functions import curriculum

    assert curriculum_for("python_functions") is curriculum


def test_the_curriculum_of_an_imported_set_picks_easy_tasks_first():
    from envs.spec import TaskSpec
    from ratchet.rollout.wave import pick_tasks

    steps = ({"action": "check_calls", "entry_point": "f"},)
    tasks = [TaskSpec(task_id=f"t{d}-{i}", family="imported-x", difficulty=d, prompt="p", execution_steps=steps,
                      tests=[{"args": "[1]", "expected": "2"}])
             for d in (1, 2, 3) for i in range(20)]
    first = [t.difficulty for s in range(5) for t in pick_tasks(tasks, 10, 0, 10, curriculum_for("imported-x"), s)]
    last = [t.difficulty for s in range(5) for t in pick_tasks(tasks, 10, 9, 10, curriculum_for("imported-x"), s)]
    assert first.count(1) > first.count(3) and last.count(3) > last.count(1)


def test_interleave_and_pass_rates_by_source():
    assert interleave([[1, 2, 3, 4], ["a"], [5, 6]]) == [1, "a", 5, 2, 6, 3, 4]
    assert interleave([]) == []
    record = lambda rows: {"tables": {"source": rows}}  # noqa: E731
    base = record([{"source": "python_functions", "n_tasks": 6, "pass_at_1": 0.5, "ci": [0.1, 0.9]},
                   {"source": "imported-x", "n_tasks": 2, "pass_at_1": 0.0, "ci": [0.0, 0.0]}])
    final = record([{"source": "imported-x", "n_tasks": 2, "pass_at_1": 1.0, "ci": [1.0, 1.0]},
                    {"source": "python_functions", "n_tasks": 6, "pass_at_1": 0.5, "ci": [0.2, 0.8]}])
    assert pass_rates_by_source({"base": base, "final": final, "incumbent": None}) == {
        "imported-x": {"base": 0.0, "base_ci": [0.0, 0.0], "base_n_tasks": 2,
                       "final": 1.0, "final_ci": [1.0, 1.0], "final_n_tasks": 2},
        "python_functions": {"base": 0.5, "base_ci": [0.1, 0.9], "base_n_tasks": 6,
                             "final": 0.5, "final_ci": [0.2, 0.8], "final_n_tasks": 6}}
    # an env_error left a task out of one column: each column says how many tasks its figure is over
    fewer = record([{"source": "imported-x", "n_tasks": 1, "pass_at_1": 1.0, "ci": [1.0, 1.0]}])
    assert pass_rates_by_source({"base": base, "final": fewer})["imported-x"]["final_n_tasks"] == 1


def test_the_tasks_cleaning_leaves_out_are_saved_with_why():
    """Found by review: dedup and decontamination dropped tasks leaving only counts; which ones, and
    why, is now kept beside the snapshot (`dropped.jsonl`), as bad lines are (`bad_lines.jsonl`)."""
    import tempfile

    prompt = "return the integer that follows x, for any integer x you are given"
    imp = import_source("d.jsonl", jsonl(task("h", prompt, split="heldout"), task("h2", prompt, split="heldout"),
                                         task("t", prompt, split="train"), task("u", "add two to x, then halve it", split="train")),
                        EnvsConfig())
    assert [(d["task_id"].rsplit("/", 1)[-1], d["split"], d["reason"]) for d in imp.dropped] == [
        ("h2", "heldout", "exact duplicate of an earlier heldout prompt"),
        ("t", "train", "contaminated: 100% of its prompt's 13-word sequences are in held-out prompts")]
    st = open_store(tempfile.mkdtemp())
    refs = save_source(st, imp)
    assert [json.loads(ln)["reason"] for ln in st.get_bytes(refs["dropped"]).decode().splitlines()] == [
        d["reason"] for d in imp.dropped]
    assert imp.production.lineage["dropped"] == "dropped.jsonl" and refs["train"].rows == 1
