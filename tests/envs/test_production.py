"""Production: deterministic snapshots, exact + near-duplicate removal, contamination, lineage."""

from __future__ import annotations

from envs.production import CleanConfig, _Cleaner, contaminated, produce, shingles
from envs.spec import CallTest, CheckCalls, TaskSpec
from ratchet.config import EnvsConfig

SMALL = EnvsConfig(n_train=60, n_heldout=12, max_difficulty=3)


def spec(prompt: str, tid: str = "t") -> TaskSpec:
    return TaskSpec(task_id=tid, family="x", prompt=prompt, execution_steps=(CheckCalls(entry_point="f"),),
                    tests=(CallTest(args="[1]", expected="2"),), reference_solution="pass")


def test_produce_is_deterministic_with_lineage():
    a, b = produce("arithmetic", SMALL), produce("arithmetic", SMALL)
    assert a.version == b.version and a.version.startswith("v1-")
    assert [s.task_id for s in a.train] == [s.task_id for s in b.train]
    assert len(a.train) == 60 and len(a.heldout) == 12
    assert {s.split for s in a.train} == {"train"} and {s.split for s in a.heldout} == {"heldout"}
    assert {s.version for s in a.train + a.heldout} == {a.version}
    lin = a.lineage
    assert lin["seed"] == 0 and len(lin["family_code_sha256"]) == 64 and lin["generator_config"]["base_range"] == 9
    c = lin["counts"]["train"]
    assert c["kept"] == 60 == sum(c["per_difficulty"].values())
    assert c["generated"] == 60 + c["exact_duplicates"] + c["near_duplicates"] + c["contaminated"]
    assert produce("arithmetic", SMALL.model_copy(update={"seed": 1})).version != a.version


def test_dedup_spills_a_small_difficulty_over_to_the_next():
    # python_functions has only ~70 distinct one-operation tasks: the rest of that quota moves up
    prod = produce("python_functions", EnvsConfig(n_train=300, n_heldout=30, max_difficulty=2))
    c = prod.lineage["counts"]["train"]
    assert c["per_difficulty"]["1"] < 100 < c["per_difficulty"]["2"] and c["exact_duplicates"] > 0
    assert len(prod.train) == 300 and c["shortfall"] == 0
    assert len({s.prompt for s in prod.train}) == len(prod.train)


def test_exact_and_near_duplicates():
    cleaner = _Cleaner(CleanConfig(), "t")
    long = ("Write a function that reads a list of integers from standard input, one per line, ignores blank "
            "lines and comments starting with a hash sign, and returns the sum of the even ones; negative numbers "
            "count too, and an empty input gives zero. Raise ValueError on anything that is not an integer, "
            "naming the offending line number in the message so that a person can fix the file quickly.")
    assert cleaner.admit(spec(long))
    assert not cleaner.admit(spec("  " + long.upper().replace(" ", "   ")))        # exact after normalising
    assert not cleaner.admit(spec(long.replace("even", "odd", 1)))                  # one word changed: near
    assert cleaner.admit(spec("Compute 3 + 4. Answer with the integer only."))
    assert (cleaner.exact, cleaner.near) == (1, 1)


def test_contamination_by_ngram_overlap():
    held = [spec("the quick brown fox jumps over the lazy dog and keeps running far away from home")]
    train = [spec("the quick brown fox jumps over the lazy dog and keeps running far away from home tonight"),
             spec("an entirely different question about prime numbers and their gaps in the integers"),
             spec("short one")]
    assert contaminated(train, held, k=8, threshold=0.5) == [True, False, False]
    assert contaminated([spec("short one")], [spec("short one")], k=8, threshold=0.5) == [True]
    assert shingles("a b c", 8) == {"a b c"}
