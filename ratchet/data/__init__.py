"""ratchet's tables: Polars schemas, Parquet in the store, Great Expectations gates.

    from ratchet.data import TRAJECTORY_SCHEMA, trajectories_frame, conform
    from ratchet.data.gates import check_wave, check_tasks     # imports GX lazily, on first check
"""

from ratchet.data.schemas import (
    AUDIT_COLUMNS,
    AUDITED_TASK_SCHEMA,
    METRICS,
    TASK_SCHEMA,
    TRAJECTORY_NULLABLE,
    TRAJECTORY_SCHEMA,
    TURN,
    SchemaError,
    conform,
    schema_diff,
    single_turn,
    tasks_frame,
    trajectories_frame,
)

__all__ = [
    "AUDIT_COLUMNS", "AUDITED_TASK_SCHEMA", "METRICS", "TASK_SCHEMA", "TRAJECTORY_NULLABLE",
    "TRAJECTORY_SCHEMA", "TURN", "SchemaError", "conform", "schema_diff", "single_turn", "tasks_frame",
    "trajectories_frame",
]
