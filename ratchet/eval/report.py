"""Evaluation tables a person reads: pass@1 with its confidence interval, base -> candidate -> incumbent.

    print(vertical_table({"base": base, "candidate": final, "incumbent": incumbent}))

Each argument is an `EvalResult.summary()` record (what `tasks/evaluate.py` stores); a column
that is None (no incumbent yet) is left out. One row per group (all tasks, then each family,
each source when sources differ from families, each difficulty when there are several), one column per checkpoint:
`pass@1 [CI low, CI high] (n)` in percent.
"""

from __future__ import annotations

from ratchet.eval import GROUPS


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    lo, hi = row["ci"]
    return f"{100 * row['pass_at_1']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}] ({row['n_tasks']})"


def _overall(summary: dict) -> dict:
    return {"pass_at_1": summary["pass_rate"], "ci": summary["ci"], "n_tasks": summary["n_tasks"]}


def table_rows(columns: dict[str, dict | None]) -> list[tuple[str, list[str]]]:
    """[(row label, [cell per column])]: "all", each family, then every group of the other
    groupings that says more (one difficulty level, or sources equal to families, is left out)."""
    cols = {name: s for name, s in columns.items() if s is not None}
    rows = [("all", [_cell(_overall(s)) for s in cols.values()])]
    seen: list[set] = []
    for by in GROUPS:
        keys = sorted({str(r[by]) for s in cols.values() for r in s["tables"][by]})
        if (by != "family" and len(keys) < 2) or set(keys) in seen:
            continue
        seen.append(set(keys))
        for key in keys:
            cells = [_cell(next((r for r in s["tables"][by] if str(r[by]) == key), None)) for s in cols.values()]
            rows.append((f"{by} {key}", cells))
    return rows


def vertical_table(columns: dict[str, dict | None], confidence: float = 0.95) -> str:
    """A markdown table of held-out pass@1 (%, with its `confidence` CI and task count) per group,
    one column per checkpoint in the order given (base -> candidate -> incumbent)."""
    cols = [name for name, s in columns.items() if s is not None]
    head = f"| held-out pass@1, % [{confidence:.0%} CI] (tasks) | " + " | ".join(cols) + " |"
    lines = [head, "|---|" + "---|" * len(cols)]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in table_rows(columns)]
    return "\n".join(lines)


def pass_rates_by_source(evals: dict[str, dict | None]) -> dict[str, dict]:
    """{source: {"<column>": pass@1, "<column>_ci": [lo, hi], "<column>_n_tasks": n}} from evaluation
    records (`EvalResult.summary()`, its `tables["source"]`), one column per record (base, final, ...);
    each column its own task count (an env_error leaves a task out of one column, not the others)."""
    out: dict[str, dict] = {}
    for column, record in evals.items():
        if record is None:
            continue
        for row in record["tables"]["source"]:
            entry = out.setdefault(str(row["source"]), {})
            entry[column], entry[f"{column}_ci"], entry[f"{column}_n_tasks"] = row["pass_at_1"], row["ci"], row["n_tasks"]
    return dict(sorted(out.items()))
