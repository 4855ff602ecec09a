"""ratchet.verify: the one judge of a task's answer.

    from ratchet.verify import verify_many
    results = verify_many([(spec, completion), ...], cfg.verify.sandbox_limits())
    results[0].passed, results[0].metrics, results[0].env_error

Waves (`ratchet.stages.verify_frame`), held-out evaluation (`ratchet.eval`), the environment
audit (`ratchet.audit`) and `ratchet verify` all call `verify_many`: one sandbox layout per
task kind, one comparison of results (`same`: canonical JSON outside the sandbox, with the
task's float tolerance if it has one), one definition of "passed" (`Verification.passed`),
and the sandbox limits from `VerifyConfig.sandbox_limits`.

Modules: `verifier` (plans a sandbox run per (task, completion), runs them in batches, reads
the metrics), `commands` (run_command lines: pytest, scripts), `guards` (reward-hacking
checks on specs and results).
"""

from ratchet.verify.verifier import Verification, passed, same, solution_files, verify_many

__all__ = ["Verification", "passed", "same", "solution_files", "verify_many"]
