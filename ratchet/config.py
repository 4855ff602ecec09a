"""ratchet's configuration: one source of truth, frozen pydantic models.

Every field carries a description and bounds; the models are used directly as Prefect flow
parameters, so the descriptions render in the Prefect UI's run form. `deploy/prefect.yaml`
holds only overrides.

    from ratchet.config import NightlyConfig
    cfg = NightlyConfig(steps=10, rl=RLConfig(estimator="rloo"))
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ratchet.sandbox.model import Limits


RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
"""A run id is one store key component (runs/<run_id>/...): no '/', and (checked apart) no '..'."""


class Frozen(BaseModel):
    """Base for every config: immutable, unknown keys are an error, and so is true or false where a
    number goes (pydantic's lax mode reads `"steps": true` as 1)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info) -> Any:
        kinds = set(get_args(cls.model_fields[info.field_name].annotation)) or {cls.model_fields[info.field_name].annotation}
        if isinstance(value, bool) and kinds & {int, float} and bool not in kinds:
            raise PydanticCustomError("bool_for_number", "expected a number, not true or false")
        return value


def describe(section: type[BaseModel], name: str) -> str:
    """A field's description, for command-line help that says what the Prefect form says."""
    return section.model_fields[name].description or ""


class StoreConfig(Frozen):
    uri: str = Field(
        ".ratchet/store",
        description="Artifact store: a local directory (path or file:// URI) or s3://bucket/prefix. "
        "S3 endpoint and credentials come from RATCHET_S3_ENDPOINT, AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY (and RATCHET_S3_SECURE=0 for plain HTTP).",
    )
    retry_budget_s: float = Field(
        120.0, ge=0, le=3600, description="S3: how long one store operation retries a transient failure (connection "
        "refused, timeout, 5xx) with backoff before the run fails with one line naming the store and the operation."
    )


class CleanConfig(Frozen):
    shingle: int = Field(3, ge=1, le=32, description="Words per shingle for near-duplicate MinHash.")
    near_dup_threshold: float = Field(0.85, gt=0, le=1, description="Jaccard similarity above which two prompts are near-duplicates.")
    num_perm: int = Field(128, ge=16, le=512, description="MinHash permutations.")
    ngram: int = Field(13, ge=1, le=64, description="Words per n-gram for the contamination check.")
    contamination_threshold: float = Field(
        0.5, gt=0, le=1, description="Share of a training prompt's n-grams found in held-out prompts that marks it contaminated."
    )
    attempts: int = Field(4, ge=1, le=100, description="Generation draws at most attempts x quota indices per difficulty.")


class EnvsConfig(Frozen):
    families: tuple[str, ...] = Field(
        ("python_functions",), description="Environment families to produce and train on."
    )
    family_config: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description='Generator settings per family, e.g. {"python_functions": {"n_tests": 12}}; each is '
        "validated against the family's own Config (envs/families/{name}.py). Unset: the family's defaults.",
    )
    clean: CleanConfig = Field(default_factory=CleanConfig, description="Dedup, near-dup and contamination filters.")
    n_train: int = Field(3000, ge=1, le=1_000_000, description="Training tasks produced per family.")
    n_heldout: int = Field(300, ge=1, le=100_000, description="Held-out evaluation tasks per family.")
    seed: int = Field(0, ge=0, description="Generation seed; task i is generated from Random(seed, i).")
    version: str = Field("v1", min_length=1, max_length=64, description="Snapshot version: the snapshot lives under envs/{family}/{version}/.")
    max_difficulty: int = Field(3, ge=1, le=5, description="Highest difficulty level produced.")
    sources: tuple[str, ...] = Field(
        (), description="Imported task sets trained on beside the families: task-spec JSONL (.jsonl, .jsonl.gz) or "
        "Parquet files, by path, file:// URI or s3:// URI inside the store. Each is imported (bad lines quarantined "
        "beside its snapshot), deduplicated, split (a line's own split wins, else a hash of its task_id), "
        "decontaminated against its held-out split, audited; pass rates are reported per source (envs/sources.py).",
    )

    @field_validator("family_config")
    @classmethod
    def _known_settings(cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        from envs.registry import get_family   # envs imports this module: resolve families at validation

        for name, settings in value.items():
            try:
                get_family(name).config.model_validate(settings)
            except KeyError as e:
                raise ValueError(str(e).strip("'\"")) from None
            except ValidationError as e:   # located under the family's name: family_config.<name>.<field>
                raise ValidationError.from_exception_data(e.title, [
                    {k: err[k] for k in ("type", "input", "ctx") if k in err} | {"loc": (name, *err["loc"])}
                    for err in e.errors()]) from None
        return value

    @field_validator("sources")
    @classmethod
    def _known_sources(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        from envs.sources import check_sources

        problems = check_sources(value)
        if problems:
            raise ValueError("; ".join(problems))
        return value

    def generator_config(self, family: str) -> BaseModel:
        """The family's generator Config with this run's settings for it."""
        from envs.registry import get_family

        return get_family(family).config.model_validate(self.family_config.get(family, {}))


class ContextPhase(Frozen):
    """One phase of context extension for the embedded model (`ModelConfig.context_phases`)."""

    seq_len: int = Field(..., ge=32, le=131072, description="The model's context in this phase: its "
                         "max_position_embeddings, and the longest retrieval sequence trained on (in tokens).")
    steps: int = Field(..., ge=0, le=100_000, description="SFT steps of this phase (retrieval sequences mixed with task demonstrations).")
    batch: int = Field(8, ge=1, le=4096, description="Sequences per SFT step in this phase (longer sequences: fewer per step).")
    rope_type: Literal["default", "linear", "dynamic", "yarn"] = Field(
        "default", description="RoPE scaling (Hugging Face `rope_parameters`) from this phase on: default = none (positions "
        "past the trained ones are extrapolated); linear = positions divided by `factor` (position interpolation); yarn = "
        "YaRN over the original model.max_seq_len; dynamic = NTK scaling applied only past seq_len, at inference."
    )
    factor: float = Field(1.0, ge=1.0, le=64.0, description="RoPE scaling factor, usually seq_len / model.max_seq_len "
                          "(1.0 with rope_type default).")
    retrieval_share: float = Field(0.5, ge=0, le=1, description="Share of this phase's training sequences that are "
                                   "needle-in-a-haystack retrieval sequences (ratchet/eval/niah.py); the rest are task demonstrations.")
    key_digits: int = Field(5, ge=1, le=32, description="Digits of the keys in this phase's retrieval sequences (probe "
                            "with the same niah.key_digits: fewer digits are learnt in fewer steps).")


class ModelConfig(Frozen):
    path: str | None = Field(
        None,
        description="A local Hugging Face model directory to post-train. Empty: build the embedded "
        "tiny Llama-style model and warm-start it with a short SFT.",
    )
    hidden_size: int = Field(192, ge=16, le=8192, description="Embedded model: hidden width.")
    num_layers: int = Field(4, ge=1, le=64, description="Embedded model: transformer blocks.")
    num_heads: int = Field(6, ge=1, le=64, description="Embedded model: attention heads.")
    vocab_size: int = Field(384, ge=64, le=65536, description="Embedded model: BPE vocabulary size.")
    max_seq_len: int = Field(256, ge=32, le=32768, description="Context length (prompt + completion).")
    sft_steps: int = Field(130, ge=0, le=100_000, description="Warm-start SFT steps on demonstrations.")
    sft_batch: int = Field(32, ge=1, le=4096, description="Warm-start SFT batch size.")
    sft_lr: float = Field(2e-3, gt=0, le=1.0, description="Warm-start SFT learning rate.")
    sft_fraction: float = Field(
        0.35, gt=0, le=1.0, description="Fraction of the training tasks whose reference solutions are SFT demonstrations."
    )
    seed: int = Field(0, ge=0, description="Seed for weight initialisation and SFT.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the policy, the rollout engine and the trainer run: auto = CUDA when a GPU is "
        "visible (cuda:LOCAL_RANK under a launcher), else CPU. DeepSpeed always uses its accelerator's device.",
    )
    dtype: Literal["float32", "bfloat16", "auto"] = Field(
        "float32", description="Dtype of the policy's weights in memory. float32: fp32 weights and optimizer (with "
        "train.bf16, bf16 autocast on CUDA); bfloat16: weights held and updated in bf16 (half the memory, lossier "
        "updates); auto: the dtype named in the model directory's config.json.",
    )
    chat_template: Literal["auto", "on", "off"] = Field(
        "auto", description="Wrap each task prompt in the tokenizer's chat template as one user turn, with the "
        "assistant's generation prompt. auto: when the tokenizer has a template (instruct models), off for the "
        "embedded model (it has none); on: required (an error without one); off: the plain prompt text.",
    )
    context_phases: tuple[ContextPhase, ...] = Field(
        (), description="Embedded model: context extension after the warm start, phase by phase (train short, then "
        "longer with RoPE scaling), e.g. [{\"seq_len\": 256, \"steps\": 200}, {\"seq_len\": 1024, \"steps\": 100, "
        "\"rope_type\": \"linear\", \"factor\": 4}]. Empty (default): no extension, context model.max_seq_len."
    )

    @field_validator("path")
    @classmethod
    def _home(cls, value: str | None) -> str | None:
        """'~' expanded once, here, for every reader: transformers takes '~/m' for a Hub repo id."""
        return os.path.expanduser(value) if value else value

    @field_validator("context_phases")
    @classmethod
    def _phases_grow(cls, value: tuple[ContextPhase, ...], info) -> tuple[ContextPhase, ...]:
        last = info.data.get("max_seq_len", 32)
        for i, phase in enumerate(value):
            if phase.seq_len < last:
                raise ValueError(f"phase {i}: seq_len {phase.seq_len} is shorter than the context before it ({last})")
            if phase.rope_type == "default" and phase.factor != 1.0:
                raise ValueError(f"phase {i}: rope_type 'default' takes no factor (got {phase.factor})")
            last = phase.seq_len
        return value


class RolloutConfig(Frozen):
    prompts_per_wave: int = Field(64, ge=1, le=65536, description="Distinct prompts sampled in one rollout wave.")
    group_size: int = Field(8, ge=2, le=256, description="Samples per prompt (the GRPO group).")
    max_new_tokens: int = Field(48, ge=1, le=8192, description="Completion length cap, in tokens.")
    temperature: float = Field(1.0, gt=0, le=5.0, description="Sampling temperature.")
    batch_size: int = Field(128, ge=1, le=65536, description="Sequences decoded together by the torch engine.")
    engine: Literal["torch", "http", "vllm"] = Field(
        "torch", description="What samples the waves: torch = the in-process engine; http = a `ratchet serve` "
        "server at engine_url; vllm = a vLLM server (GPU), started from vllm_python or reached at engine_url. "
        "A server gets each new policy version's weights through sync_dir (ratchet/rollout/behaviour.py).")
    engine_url: str | None = Field(
        None, description="URL of the engine server (http: required; vllm: use this server instead of starting one), "
        "e.g. http://10.0.0.5:8000. It must read sync_dir at the same path.")
    vllm_python: str | None = Field(
        None, description="The python of vLLM's own virtual environment (vllm engine without engine_url): ratchet "
        "starts `{vllm_python} -m vllm.entrypoints.cli.main serve` with prefix caching and stops it at exit.")
    vllm_args: tuple[str, ...] = Field(
        (), description="Extra arguments for the vLLM server, e.g. [\"--gpu-memory-utilization\", \"0.4\"] when the "
        "trainer shares its GPU, [\"--tensor-parallel-size\", \"2\"] on a GPU of its own.")
    vllm_sync: Literal["reload", "restart"] = Field(
        "reload", description="How the vLLM server gets each new policy version: reload = in place from the version's "
        "directory (dev-mode /collective_rpc reload_weights, then /reset_prefix_cache); restart = a new server on it.")
    request_timeout_s: float = Field(
        600.0, gt=0, le=86_400, description="Server engines (http, vllm): how long one wave's request may take before "
        "it fails (retried as transient); a wave's whole generation is one request, so a large wave on a slow "
        "server needs more.")
    sync_dir: str | None = Field(
        None, description="Directory where each policy version's weights are written for a server engine to load "
        "(shared with the server's machine). Empty: a local scratch directory.")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: each wave is sampled by the policy that then trains on it. async: the engine samples "
        "up to max_staleness waves ahead while the trainer trains, from a copy of older weights; the loss corrects "
        "the gap with truncated importance sampling (rl.is_cap).")
    max_staleness: int = Field(
        1, ge=1, le=64, description="async: how many policy versions older than the trainer a wave's behaviour policy "
        "may be; the engine runs this many waves ahead (wave k is sampled by version k - max_staleness).")

    @model_validator(mode="after")
    def _engine_reachable(self):
        if self.engine == "http" and not self.engine_url:
            raise ValueError("rollout.engine: 'http' needs rollout.engine_url (the `ratchet serve` URL)")
        if self.engine == "vllm" and not (self.engine_url or self.vllm_python):
            raise ValueError("rollout.engine: 'vllm' needs rollout.vllm_python (to start vLLM) or rollout.engine_url")
        if self.vllm_sync == "restart" and self.engine_url and self.engine == "vllm":
            raise ValueError("rollout.vllm_sync: 'restart' needs a server ratchet starts (vllm_python), not engine_url")
        return self


class AgentConfig(Frozen):
    """Multi-turn episodes: the model answers, the sandbox's verdict comes back as an observation, the model
    revises (ratchet/agent.py). turns 1 is single-turn sampling."""

    turns: int = Field(
        1, ge=1, le=64, description="Most turns per episode: 1 = one answer per prompt (single-turn); K of 2 or more = "
        "answer, read the sandbox's feedback, revise, up to K answers. Evaluation runs the same K turns and reports "
        "the pass rate after every turn (turn 1 is the single-turn figure).")
    observation_tokens: int = Field(
        48, ge=8, le=8192, description="Token budget of one observation (tests passed and failed, the failing "
        "assertion, the error tail); longer feedback is cut to it.")
    stop_on_pass: bool = Field(
        True, description="End an episode at the first answer that passes; off: every episode runs to the turn or "
        "context limit. An episode also ends when the next turn would not fit in the model's context.")
    turn_penalty: float = Field(
        0.0, ge=0, le=1, description="Per-turn shaping: subtracted from the trajectory's reward (the final answer's) "
        "for each turn after the first, so that solving sooner is worth more. 0: the final state's reward alone.")
    repeat_reward: float | None = Field(
        None, ge=-1, le=1, description="Per-turn shaping: the reward of a revision that repeats the failed answer "
        "before it (whitespace aside), in place of its own. A repeat gets the same verdict, so with partial credit "
        "it keeps the score of a near miss and is the safe choice against a change that breaks more tests; "
        "0 scores it as a failure. Empty: scored as any answer.")
    credit: Literal["trajectory", "turn"] = Field(
        "trajectory", description="What each answer of an episode is credited with. trajectory: every answer gets "
        "the episode's advantage (from its final reward). turn: answer 1 gets the group-relative advantage of its "
        "reward, as a single-turn answer does; a revision (answer 2 or later) is compared with the task's other revisions "
        "at its turn (its reward less turn_penalty per turn taken), so it is judged by what it fixed, not against the "
        "episodes that passed earlier (with stop_on_pass off, an episode that passed answers again and is "
        "one of them). turn needs a per-task group estimator (grpo, dr_grpo or rloo) and "
        "rl.kl_in_reward off.")
    branch: int = Field(
        1, ge=1, le=64, description="Training waves (turns of 2 or more): each first answer is sampled once and "
        "shared by this many episodes of its group, which revise it apart, so that a failed answer gets that many "
        "revisions from one state and, with credit turn, the second answers are judged against the other revisions "
        "of the same answer (not of the task's other answers). rollout.group_size must be a multiple of it; the "
        "copies are not counted as sampled tokens (they are still decoded and verified in their rows, and each "
        "trains as its episode's first answer). 1: every episode samples its own first answer. Evaluation "
        "never branches.")
    revision_demos: float = Field(
        0.0, ge=0, le=1, description="Embedded model's warm start: fraction of the training tasks (those with a "
        "reference solution) that get a revision demonstration (1 to turns - 1 wrong attempts, each followed by the "
        "sandbox's real feedback on it, then the fix), so that the model has seen a revision at every turn an episode "
        "reaches before RL.")
    own_revision_steps: int = Field(
        0, ge=0, le=100_000, description="Embedded model's warm start: after its SFT, sample the model's own answers "
        "(up to turns - 1 per task, at least 1; at rollout.temperature) on the tasks that got a revision demo, and SFT this many "
        "more steps on revision demos that start from its own failed answers (each with its real feedback, then the "
        "reference), mixed with the demonstrations. A mutant of the reference is not a mistake the model makes; "
        "its own are what it repeats. 0: off. Needs revision_demos.")

    @model_validator(mode="after")
    def _own_revisions_need_demo_tasks(self):
        if self.own_revision_steps and not self.revision_demos:
            raise ValueError(f"agent.own_revision_steps {self.own_revision_steps}: the own-mistake demos are sampled on "
                             f"the tasks that get a revision demo; set agent.revision_demos above 0")
        return self


class RLConfig(Frozen):
    estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"] = Field(
        "grpo", description="Advantage estimator (ratchet.rl.advantages registry)."
    )
    clip_low: float = Field(0.2, ge=0, le=1, description="Lower PPO clip: ratio at least 1 - clip_low.")
    clip_high: float = Field(0.2, ge=0, le=10, description="Upper PPO clip: ratio at most 1 + clip_high (DAPO clip-higher: 0.28).")
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm",
                      "answer_mean_token_mean"] = Field(
        "answer_mean_token_mean",
        description="How per-token losses reduce to one number (token- vs sequence-level). token_mean lets long "
        "failed completions outweigh short correct ones; on the embedded model it undid the SFT warm start. "
        "answer_mean_token_mean: each answer of a multi-turn episode is a sequence of its own, so that a revision "
        "is not weighed as 1/K of its episode (single-turn it is seq_mean_token_mean, bit for bit); bench.multiturn: "
        "+5.8 points over 4 seeds against +2.4 with seq_mean_token_mean.",
    )
    kl_coef: float = Field(0.0, ge=0, le=10, description="KL-to-reference coefficient; 0 skips the reference model.")
    kl_estimator: Literal["k1", "k2", "k3"] | None = Field(
        None, description="KL estimator (Schulman's k1/k2/k3); unset: k2 in the loss, k3 in the reward. In the loss, "
        "k2's gradient is that of KL(pi || pi_ref), k3's that of KL(pi_ref || pi) (DeepSeekMath's GRPO), and k1's is "
        "zero in expectation, so k1 is refused there. In the reward (kl_in_reward) it is a value: k1 and k3 are "
        "unbiased estimates of KL(pi || pi_ref), k2 a biased one with less variance.")
    kl_in_reward: bool = Field(False, description="Apply the KL penalty to the reward instead of the loss.")
    entropy_coef: float = Field(0.0, ge=0, le=1, description="Entropy bonus coefficient.")
    is_cap: float = Field(2.0, ge=1, le=100, description="Truncation of the off-policy importance weight (TIS).")
    drop_zero_variance: bool = Field(True, description="Drop groups whose rewards are all equal (dynamic sampling).")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount (PPO only).")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda (PPO only).")
    value_coef: float = Field(0.5, ge=0, le=10, description="Value loss coefficient (PPO only).")

    @property
    def kl(self) -> str:
        """The KL estimator used: `kl_estimator`, else k3 in the reward (unbiased) and k2 in the loss."""
        return self.kl_estimator or ("k3" if self.kl_in_reward else "k2")

    @model_validator(mode="after")
    def _kl_in_the_loss_has_a_gradient(self):
        if self.kl_coef > 0 and not self.kl_in_reward and self.kl_estimator == "k1":
            raise ValueError("rl.kl_estimator 'k1' in the loss has zero expected gradient (no KL control, only "
                             "variance): use 'k2' or 'k3' there, or set rl.kl_in_reward")
        return self


class TrainConfig(Frozen):
    backend: Literal["torch", "deepspeed"] = Field("torch", description="Trainer backend.")
    lr: float = Field(1e-4, gt=0, le=1.0, description="Adam learning rate for RL updates.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, le=100_000, description="Linear LR warm-up, in optimizer steps.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="LR after warm-up: constant, or cosine decay.")
    lr_decay_steps: int = Field(0, ge=0, le=10_000_000, description="Cosine: optimizer steps to decay over (0: no decay).")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine: floor of the LR as a fraction of lr.")
    minibatch_prompts: int = Field(8, ge=1, le=65536, description="Prompts (groups) per optimizer step.")
    updates_per_batch: int = Field(2, ge=1, le=64, description="Passes over each minibatch (PPO epochs).")
    token_budget: int = Field(8192, ge=64, le=10_000_000, description="Largest micro-batch in padded tokens (dynamic batching: "
                              "rows of like length are cut into micro-batches for the least padding under it).")
    max_grad_norm: float = Field(1.0, gt=0, le=1000, description="Gradient clipping norm.")
    zero_stage: int = Field(2, ge=0, le=3, description="DeepSpeed ZeRO stage (3: only for `python -m ratchet.train.launch`; "
                            "a run samples in-process from the trainer's module, which ZeRO-3 partitions).")
    offload: bool = Field(False, description="DeepSpeed: offload optimizer state to CPU (and, at ZeRO-3, the parameters).")
    bf16: bool = Field(False, description="bf16 autocast (GPU) / DeepSpeed bf16.")
    seed: int = Field(0, ge=0, description="Seed for data order and sampling.")


class VerifyConfig(Frozen):
    timeout_s: float = Field(5.0, gt=0, le=600, description="Wall-clock (and CPU-time) limit of one verification run.")
    memory_mb: int = Field(512, ge=32, le=65536, description="Address-space limit of one verification run.")
    concurrency: int = Field(2, ge=1, le=1024, description="Verification runs in parallel.")
    env_error_retries: int = Field(2, ge=0, le=10, description="Retries of a run that failed for infrastructure reasons.")
    feedback_bytes: int = Field(2048, ge=0, le=1_000_000, description="Bytes of stdout and of stderr (their tails) kept "
                                "with each verified row of a wave, for `ratchet trace`.")
    executor: Literal["local", "ray"] = Field(
        "local", description="Where sandbox runs execute: `local` (this process's sandbox) or `ray` (fanned out as Ray "
        "tasks over the cluster at `ray_address`, each running a chunk through the same sandbox on its node; a node's "
        "custom resource `sandbox` caps its concurrent runs across flows). Waves, evaluation and the audit alike; "
        "training stays in the flow's process (ratchet/scale/).")
    ray_address: str = Field(
        "auto", min_length=1, description="Ray cluster for `executor: ray`: `auto` (the cluster this machine joined with "
        "`ray start`, or $RAY_ADDRESS), `ray://HOST:10001` (Ray client), `HOST:6379`, or `local` (a private "
        "one-machine cluster, for trying it).")
    ray_chunk: int = Field(8, ge=1, le=100_000, description="Sandbox runs per Ray task with `executor: ray` (each task "
                           "runs its chunk `concurrency` at a time on one node; smaller chunks spread a wave wider).")

    def sandbox_limits(self) -> Limits:
        """The sandbox limits of one verification run: the only mapping from these settings to the
        sandbox, used by waves, evaluation, the audit and every command alike."""
        return Limits(wall_s=self.timeout_s, cpu_s=self.timeout_s, memory_mb=self.memory_mb)


class AuditConfig(Frozen):
    reference_runs: int = Field(3, ge=1, le=10, description="Runs of the reference; every one must pass (else: flaky).")
    max_mutants: int = Field(8, ge=0, le=200, description="Mutants of the reference tried per task (0: no mutation testing).")
    max_command_mutants: int = Field(3, ge=0, le=200, description="Mutants per run_command task (each costs a process, e.g. pytest).")
    mutation_threshold: float = Field(0.8, ge=0, le=1, description="Least fraction of mutants the tests must kill (else: weak_tests).")
    max_reference_ms: float = Field(2000.0, gt=0, description="Wall-time budget of one reference run (else: too_slow).")
    max_prompt_chars: int = Field(16000, ge=1, description="Prompt budget in characters (else: too_long).")
    candidate_wall_s: float = Field(1.0, gt=0, le=600, description="Wall-clock limit of a trivial-answer or mutant run (a mutant that loops is killed).")
    batch_probes: bool = Field(True, description="Run the extra candidates of a check_calls task together in one sandbox run.")


class RewardConfig(Frozen):
    partial_credit: bool = Field(True, description="Score the fraction of tests passed; off: 1.0 only for a full pass, else 0.")
    timeout_reward: float = Field(-0.5, ge=-10, le=10, description="Reward of a run killed by its wall-clock limit.")
    security_penalty: float | None = Field(
        0.0, ge=-10, le=10, description="Reward of a run that raised a security flag (empty: flags do not change the reward)."
    )
    format_weight: float = Field(0.0, ge=0, le=1, description="Weight of format compliance mixed into the reward.")
    overlong_buffer: int = Field(
        0, ge=0, le=8192, description="DAPO's soft overlong punishment (tokens; 0: off): an answer that reaches into the last "
        "this many tokens before rollout.max_new_tokens loses overlong_penalty times the fraction of the buffer it "
        "reaches, all of it at the cap, so that answers that run to the cap stop paying. Every answer of an episode by "
        "its own length; with agent.credit 'trajectory' only the episode's reward (its last answer's) trains.")
    overlong_penalty: float = Field(1.0, ge=0, le=10, description="The most an answer loses to overlong_buffer (at the cap).")


class GateConfig(Frozen):
    max_env_error_rate: float = Field(0.05, ge=0, le=1, description="Largest tolerated fraction of env_error rows in a wave.")
    max_zero_variance_frac: float = Field(
        0.95, ge=0, le=1, description="Largest tolerated fraction of groups whose rewards are all equal."
    )


class EvalConfig(Frozen):
    n_tasks: int = Field(300, ge=1, le=100_000, description="Held-out tasks evaluated.")
    samples: int = Field(
        1, ge=1, le=256, description="Samples per held-out task: 1 = one greedy completion (pass@1); k of 2 or more = k completions "
        "at `temperature`, scored as unbiased pass@1 and pass@k, the same seed for candidate and incumbent."
    )
    temperature: float = Field(1.0, gt=0, le=5.0, description="Sampling temperature of evaluation when samples is 2 or more.")
    min_gain: float = Field(
        0.0, ge=0, le=1, description="A checkpoint is promoted only if the lower bound of the confidence interval of its "
        "held-out pass-rate gain over the incumbent (same tasks, paired) is above this (a fraction: 0.02 = 2 points)."
    )
    confidence: float = Field(
        0.95, gt=0.5, lt=1, description="Confidence of the paired test behind promotion: paired bootstrap interval over "
        "tasks, and an exact sign test over tasks (McNemar's at one sample per task) at p below 1 - confidence."
    )
    every: int = Field(0, ge=0, le=100_000, description="Also evaluate every N waves during training (0: only at the end).")


class MonitorConfig(Frozen):
    """Health monitors over the run's waves (`ratchet.monitor`): a monitor whose signal breaches its
    threshold for `patience` waves in a row stops the run before promotion, naming the signal, the
    wave and the values. A threshold left empty (null) turns that monitor off. The defaults sit
    well outside what healthy default runs record (see the README, "Health monitors")."""

    enabled: bool = Field(True, description="Check the health monitors after every wave (off: none is checked).")
    patience: int = Field(
        2, ge=1, le=1000, description="Consecutive waves a signal must breach its threshold before its monitor trips.")
    baseline_waves: int = Field(
        3, ge=1, le=1000, description="The run's first N waves, averaged, are the baseline of the entropy-ratio and "
        "length-drift monitors (which judge only the waves after them).")
    reward_window: int = Field(
        3, ge=1, le=1000, description="Waves averaged into the reward mean that the reward-collapse monitor compares "
        "with its running best (a moving average: one wave's reward is noisy).")
    reward_collapse_frac: float | None = Field(
        0.5, gt=0, lt=1, description="Reward collapse: the moving-average reward mean falls below this fraction of its "
        "running best (empty: off).")
    reward_min_best: float = Field(
        0.05, gt=0, le=1000, description="Reward collapse is judged only once the running best reaches this (a best near "
        "zero is noise, not a level to fall from).")
    entropy_floor: float | None = Field(
        0.02, ge=0, le=100, description="Entropy collapse: the sampling policy's entropy (nats per token, from the "
        "behaviour log-probs) below this floor (empty: off).")
    entropy_min_ratio: float | None = Field(
        0.1, gt=0, lt=1, description="Entropy collapse: the entropy below this fraction of its baseline (empty: off).")
    max_kl: float | None = Field(
        1.0, gt=0, le=1000, description="KL blow-up: the KL to the reference (nats per token; recorded when a positive rl.kl_coef "
        "puts it in the loss) above this (empty: off).")
    max_approx_kl: float | None = Field(
        0.1, gt=0, le=1000, description="KL blow-up: the approximate KL between the policy before a minibatch's steps "
        "and after its earlier ones (the trainer's approx_kl, k3, averaged over the wave's passes after each minibatch's "
        "first) above this (empty: off). Needs train.updates_per_batch 2 or more: with one pass there is nothing to "
        "compare and no approx_kl is recorded (max_kl watches the KL to the reference).")
    length_drift_factor: float | None = Field(
        2.5, gt=1, le=1000, description="Completion-length drift: the mean completion length (tokens) above this factor "
        "of its baseline, or below its inverse (empty: off). A healthy default run grew 2.2x while its pass rate tripled.")
    max_env_error_rate: float | None = Field(
        0.02, ge=0, le=1, description="env_error spike: the fraction of env_error rows above this for `patience` waves "
        "(the wave gate's gate.max_env_error_rate rejects a single wave; empty: off).")
    max_zero_variance_frac: float | None = Field(
        0.9, ge=0, le=1, description="Zero-variance share: the fraction of whole groups whose rewards are all equal (no "
        "learning signal) above this (empty: off).")


class WatchConfig(Frozen):
    every: int = Field(
        10, ge=0, le=100_000, description="Publish the per-wave table and the curves as artifacts on the flow run's "
        "page every N waves, and at the end (0: only at the end).")
    tensorboard: bool = Field(
        True, description="Write each wave's scalars as TensorBoard event files in the store, under "
        "runs/{run_id}/tensorboard/ (`tensorboard --logdir` on it, for a local store).")
    plots: bool = Field(
        True, description="Draw the curves (runs/{run_id}/plots/curves.png) and show them with the table; off: the table only.")


class NightlyConfig(Frozen):
    """The nightly training cycle: produce → audit → (rollout → score → gate → train) × steps → evaluate → promote."""

    run_id: str | None = Field(
        None, max_length=128, pattern=RUN_ID_PATTERN,
        description="Run id: letters, digits and '._-' (no '..'); an existing one resumes. Empty: a timestamped id.",
    )
    steps: int = Field(90, ge=1, le=1_000_000, description="Rollout waves (each followed by a training epoch).")
    checkpoint_every: int = Field(10, ge=1, le=1_000_000, description="Write a checkpoint every N waves (and at the end).")
    store: StoreConfig = Field(default_factory=StoreConfig, description="Where artifacts live.")
    envs: EnvsConfig = Field(default_factory=EnvsConfig, description="Environment production.")
    audit: AuditConfig = Field(default_factory=AuditConfig, description="Environment quality audit.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout engine and sampling.")
    agent: AgentConfig = Field(default_factory=AgentConfig, description="Multi-turn episodes: answer, feedback, revise.")
    rl: RLConfig = Field(default_factory=RLConfig, description="Advantages and losses.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Trainer backend and optimisation.")
    verify: VerifyConfig = Field(default_factory=VerifyConfig, description="Sandboxed verification.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="How verifier metrics become rewards.")
    gate: GateConfig = Field(default_factory=GateConfig, description="Validation gate thresholds.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation and promotion.")
    monitor: MonitorConfig = Field(
        default_factory=MonitorConfig, description="Health monitors: stop a run whose training goes bad, before promotion.")
    watch: WatchConfig = Field(default_factory=WatchConfig, description="Watching a run: TensorBoard, curves, table.")

    @field_validator("run_id")
    @classmethod
    def _no_parent(cls, value: str | None) -> str | None:
        if value is not None and ".." in value:
            raise ValueError("a run id may not contain '..'")
        return value

    @model_validator(mode="after")
    def _episodes_need_the_torch_engine(self):
        if self.agent.turns > 1 and self.rollout.engine != "torch":
            raise ValueError(f"agent.turns {self.agent.turns}: multi-turn episodes run on the torch engine (they extend "
                             f"each episode's KV cache in place); rollout.engine is {self.rollout.engine!r}")
        return self

    @model_validator(mode="after")
    def _branches_within_a_group(self):
        if self.agent.branch > 1 and (self.agent.turns < 2 or self.rollout.group_size % self.agent.branch):
            raise ValueError(f"agent.branch {self.agent.branch}: the episodes of a group share first answers in tuples "
                             f"of that many, revised apart; it needs agent.turns of 2 or more (is {self.agent.turns}) "
                             f"and a rollout.group_size that is a multiple of it (is {self.rollout.group_size})")
        return self

    @model_validator(mode="after")
    def _overlong_buffer_within_the_cap(self):
        if self.reward.overlong_buffer > self.rollout.max_new_tokens:
            raise ValueError(f"reward.overlong_buffer {self.reward.overlong_buffer} is longer than an answer can be "
                             f"(rollout.max_new_tokens {self.rollout.max_new_tokens})")
        return self

    @model_validator(mode="after")
    def _turn_credit_needs_group_advantages(self):
        if self.agent.credit == "turn":
            bad = [f"rl.estimator {self.rl.estimator!r}"] if self.rl.estimator in ("gae", "reinforce_pp") else []
            bad += ["rl.kl_in_reward"] if self.rl.kl_in_reward else []
            if bad:
                raise ValueError(f"agent.credit 'turn' compares each answer with the other answers of its task at "
                                 f"its turn (a per-task group estimator: grpo, dr_grpo or rloo); it does not combine "
                                 f"with {' or '.join(bad)}")
        return self


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`override` laid over `base` at every depth: a key both hold as mappings is merged, any other
    value of `override` replaces base's (a list, a scalar, None), a key override lacks keeps base's.
    Neither argument is modified.

    Prefect lays a run's parameters over its deployment's one level deep only, so
    `-p cfg='{"steps": 10}'` would replace the deployment's whole `cfg` (its store, its min_gain);
    the flows merge with this instead (flows/settings.py)."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


class NiahConfig(Frozen):
    """The needle-in-a-haystack probe (`ratchet eval niah`, flows/niah.py): recall of a key buried in filler."""

    lengths: tuple[int, ...] = Field(
        (), description="Prompt lengths probed, in tokens. Empty: four lengths evenly up to the model's "
        "max_position_embeddings less the answer room."
    )
    depths: tuple[float, ...] = Field(
        (0.0, 0.25, 0.5, 0.75, 1.0), description="Where the needle sits: fraction of the haystack before it (0 = first, 1 = last)."
    )
    trials: int = Field(4, ge=1, le=1000, description="Haystacks per (depth, length) cell, each with its own key and filler.")
    key_digits: int = Field(5, ge=1, le=32, description="Digits of the key ('The key is 40213.').")
    seed: int = Field(0, ge=0, description="Seed of the filler text and the keys: the same seed, the same haystacks.")
    batch_size: int = Field(16, ge=1, le=4096, description="Prompts decoded together.")
    beyond_limit: bool = Field(
        False, description="Allow lengths past the model's max_position_embeddings (to measure extrapolation); else they are an error."
    )

    @field_validator("depths")
    @classmethod
    def _fractions(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        bad = [d for d in value if not 0.0 <= d <= 1.0]
        if bad or not value:
            raise ValueError(f"depths must be fractions in [0, 1], at least one (got {list(value)})")
        return value
