"""Settings checked before anything starts: every problem of a NightlyConfig that would only
show up minutes (or waves) later, found in a second and reported all at once.

    from ratchet.preflight import check, require
    problems = check(cfg)          # one human message per problem; [] = fine
    require(cfg)                   # raises SettingsError listing them all

`ratchet run` calls `require` before importing Prefect. What is checked:
- store.uri: a path, file:///path or s3://bucket/prefix (and a valid S3 bucket name);
- a local store: the directory exists and is writable, or the nearest existing parent is
  a writable directory (nothing is created here);
- an S3 store: RATCHET_S3_ENDPOINT and AWS credentials are set, the endpoint answers within
  a few seconds (no retries), the bucket exists or can be created (a missing bucket is
  created here: open_store would do it a moment later, and trying is the only way to know);
- run_id: letters, digits, '._-', no '..', at most 128 characters;
- model.path: a Hugging Face causal LM directory: config.json (JSON, a model_type transformers
  knows, a *ForCausalLM architecture when it names one); weights (a shard index's shards present,
  each safetensors header readable and naming, at their shapes, the weights of the model config.json
  describes; no tensor loaded); a tokenizer that loads, no larger than the model's vocab_size; an
  EOS token (tokenizer, generation config or config, as the loader resolves it); a chat template
  (if chat_template is "on") that renders a user turn (unless "off") and, with agent.turns > 1, a
  new user turn after an answer, as the episodes append it; and a context (max_position_embeddings)
  that holds model.max_seq_len and the completions;
- model.device "cuda": a GPU is visible;
- envs: every family is registered; version is one store key component; every task source
  (`envs.sources`) can be read and has at least one good task line, and tasks of both splits (an
  s3:// source must lie in the store; it is read when the run imports it);
- the embedded model: hidden_size splits into num_heads heads of even size (rotary); no
  chat_template "on" (its tokenizer has no template); rollout.max_new_tokens leaves room for a
  prompt in model.max_seq_len;
- train.backend deepspeed: deepspeed is installed; zero_stage is not 3 (the run's in-process engine
  samples and evaluates with the trainer's module, whose parameters ZeRO-3 partitions).
No Prefect is imported here, and nothing but a missing S3 bucket is ever created.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import warnings
from contextlib import contextmanager
from pathlib import Path

from ratchet.config import RUN_ID_PATTERN, NightlyConfig

S3_TIMEOUT_S = 3.0
S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class SettingsError(ValueError):
    """One or more settings that cannot work; `problems` holds one message each."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = list(problems)


def require(cfg: NightlyConfig) -> None:
    """Raise SettingsError listing every problem `check` finds."""
    problems = check(cfg)
    if problems:
        raise SettingsError(problems)


def check(cfg: NightlyConfig) -> list[str]:
    """Every problem of `cfg` that would otherwise fail later; [] when it can run."""
    problems = []
    if cfg.run_id is not None:
        problems += check_run_id(cfg.run_id)
    problems += check_store(cfg.store.uri)
    problems += _model(cfg)
    problems += _envs(cfg)
    problems += _sources(cfg)
    if cfg.train.backend == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        problems.append("train.backend: 'deepspeed' is not installed in this environment (pip install deepspeed)")
    if cfg.train.backend == "deepspeed" and cfg.train.zero_stage == 3:
        problems.append("train.zero_stage 3: ZeRO-3 partitions the policy's parameters, and the run samples and "
                        "evaluates with that same module in this process (its engine would see empty weights); use "
                        "zero_stage 0-2 for a run (ZeRO-3 trains a stored wave with `python -m ratchet.train.launch`)")
    return problems


def check_run_id(run_id: str) -> list[str]:
    """The run id becomes a store key component: runs/<run_id>/..."""
    if not re.fullmatch(RUN_ID_PATTERN, run_id) or ".." in run_id or len(run_id) > 128:
        return [f"run_id {run_id!r}: use letters, digits and '._-' (starting with a letter or digit, "
                "no '..', at most 128 characters)"]
    return []


def check_store(uri: str) -> list[str]:
    """Problems of the store at `uri`: its scheme, then whether it can be reached and written."""
    if uri.startswith("s3://"):
        return _s3(uri)
    if "://" in uri and not uri.startswith("file://"):
        scheme = uri.split("://", 1)[0]
        return [f"store.uri {uri!r}: unsupported scheme {scheme!r}; use a path, file:///path or s3://bucket/prefix"]
    path = uri[len("file://"):] if uri.startswith("file://") else uri
    if not path:
        return [f"store.uri {uri!r}: names no directory"]
    return _local(Path(path).expanduser(), uri)


def _local(path: Path, uri: str) -> list[str]:
    path = path.absolute()
    if path.exists():
        if not path.is_dir():
            return [f"store.uri {uri!r}: {path} exists and is not a directory"]
        if not os.access(path, os.W_OK | os.X_OK):
            return [f"store.uri {uri!r}: directory {path} is not writable"]
        return []
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return [f"store.uri {uri!r}: cannot create {path}: {parent} is not a directory"]
    if not os.access(parent, os.W_OK | os.X_OK):
        return [f"store.uri {uri!r}: cannot create {path}: {parent} is not writable"]
    return []


def _s3(uri: str) -> list[str]:
    bucket = uri[len("s3://"):].partition("/")[0]
    if not bucket:
        return [f"store.uri {uri!r}: names no bucket; use s3://bucket/prefix"]
    if not S3_BUCKET.match(bucket) or ".." in bucket:
        return [f"store.uri {uri!r}: {bucket!r} is not a valid S3 bucket name "
                "(3-63 characters: lowercase letters, digits, '.' and '-')"]
    problems = []
    if not os.environ.get("RATCHET_S3_ENDPOINT"):
        problems.append(f"store.uri {uri!r}: set RATCHET_S3_ENDPOINT=host:port (RATCHET_S3_SECURE=0 for plain http)")
    missing = [v for v in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if not os.environ.get(v)]
    if missing:
        problems.append(f"store.uri {uri!r}: credentials unset: {' and '.join(missing)}")
    return problems or _s3_reach(uri, bucket)


def _s3_reach(uri: str, bucket: str) -> list[str]:
    """One request with a short timeout and no retries: does the endpoint answer, does the
    bucket exist (else: can it be created)?"""
    import urllib3
    from minio import Minio
    from minio.error import S3Error

    endpoint = os.environ["RATCHET_S3_ENDPOINT"]
    host, secure = endpoint, os.environ.get("RATCHET_S3_SECURE", "1").strip().lower() not in ("0", "false", "no")
    for scheme, is_secure in (("https://", True), ("http://", False)):   # as ratchet.store.s3.client_from_env
        if host.startswith(scheme):
            host, secure = host[len(scheme):], is_secure
    http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=S3_TIMEOUT_S, read=S3_TIMEOUT_S),
                               retries=urllib3.Retry(total=0, redirect=0))
    try:
        client = Minio(host.rstrip("/"), access_key=os.environ["AWS_ACCESS_KEY_ID"],
                       secret_key=os.environ["AWS_SECRET_ACCESS_KEY"], session_token=os.environ.get("AWS_SESSION_TOKEN"),
                       secure=secure, http_client=http,
                       region=os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1")
    except ValueError as e:
        return [f"RATCHET_S3_ENDPOINT {endpoint!r}: {e}"]
    try:
        if not client.bucket_exists(bucket):
            client.make_bucket(bucket)
    except S3Error as e:
        if e.code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            return []
        return [f"store.uri {uri!r}: bucket {bucket!r} at {endpoint} is not usable: {e.code}: {e.message}"]
    except (urllib3.exceptions.HTTPError, OSError, ValueError) as e:
        why = str(getattr(e, "reason", None) or e).splitlines()[0][:200]
        return [f"store.uri {uri!r}: S3 endpoint {endpoint} does not answer ({type(e).__name__}: {why})"]
    finally:
        http.clear()
    return []


def _model(cfg: NightlyConfig) -> list[str]:
    m, problems = cfg.model, []
    if m.path:
        problems += check_model_dir(m.path, cfg)
    elif m.hidden_size % m.num_heads or (m.hidden_size // m.num_heads) % 2:
        problems.append(f"model.hidden_size {m.hidden_size} must split into model.num_heads {m.num_heads} heads "
                        "of an even size (rotary embeddings)")
    if not m.path and m.chat_template == "on":
        problems.append("model.chat_template 'on': the embedded model (no model.path) has no chat template "
                        "(set 'auto' or 'off', or give a model.path whose tokenizer has one)")
    if cfg.rollout.max_new_tokens >= m.max_seq_len:
        problems.append(f"rollout.max_new_tokens {cfg.rollout.max_new_tokens} leaves no room for a prompt in "
                        f"model.max_seq_len {m.max_seq_len}")
    if m.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            problems.append("model.device 'cuda': no CUDA device is visible (use 'auto' or 'cpu')")
    return problems


WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
PROBE = "def f(x):\n"   # a prompt rendered through the chat template, as the run renders every task's


def check_model_dir(path: str, cfg: NightlyConfig | None = None) -> list[str]:
    """Problems of `path` as a Hugging Face causal LM directory (model.path, `ratchet run --model`).
    A directory that is not one at all is one problem. The config, generation config and tokenizer
    load as `load_policy` loads them and go through its own functions (pad and EOS, chat template on
    one prompt); the weights are checked by their headers and shard list, never loaded. Without the
    run's `cfg` (`ratchet serve`, `ratchet eval`: no chat template, no run context) only what
    loading the directory needs is checked."""
    with _quiet():
        return _model_dir(path, cfg)


def _model_dir(path: str, cfg: NightlyConfig | None) -> list[str]:
    from transformers import AutoTokenizer

    from ratchet.model import context_length, encode_prompts, eos_ids, model_header, pad_left, use_chat_template

    where, p = f"model.path {path!r}", Path(path)   # as load_policy reads it (ModelConfig expands '~')
    if not p.exists():
        return [f"{where}: no such directory"]
    if not p.is_dir():
        return [f"{where}: not a directory (a Hugging Face model directory is expected)"]
    if not (p / "config.json").is_file():
        return [f"{where}: no config.json, so not a Hugging Face model directory"]
    try:
        config = json.loads((p / "config.json").read_text())
    except (ValueError, OSError) as e:
        return [f"{where}: config.json is not readable JSON ({e})"]
    if not isinstance(config, dict) or not config.get("model_type"):
        return [f"{where}: config.json names no model_type, so not a Hugging Face model directory"]
    problems, head, tok = [], None, None
    archs = config.get("architectures") or []
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        problems.append(f"{where}: config.json's architectures {archs} name no causal LM (…ForCausalLM)")
    try:
        head = model_header(p)
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError, KeyError, TypeError... for a config it cannot build
        problems.append(f"{where}: transformers cannot load config.json ({_why(e)})")
    problems += _weights(p, where, head)
    if not any((p / name).is_file() for name in TOKENIZER):
        problems.append(f"{where}: no tokenizer files ({', '.join(TOKENIZER)})")
    else:
        try:
            tok = AutoTokenizer.from_pretrained(p)
        except Exception as e:  # noqa: BLE001 - as many kinds as tokenizer formats
            problems.append(f"{where}: the tokenizer does not load ({_why(e)})")
    if head is not None and tok is not None:
        try:
            eos_ids(head, pad_left(tok, head))
        except ValueError:
            problems.append(f"{where}: no end-of-sequence token: neither the tokenizer nor generation_config.json "
                            "nor config.json names one (a completion could never end, nor a batch be padded)")
        vocab = getattr(head.config, "vocab_size", None)
        if isinstance(vocab, int) and len(tok) > vocab:   # fewer is common (padded embeddings); more breaks forward
            problems.append(f"{where}: the tokenizer has {len(tok)} tokens, more than the model's {vocab} embedding "
                            "rows (config.json vocab_size): is it this model's tokenizer?")
    if tok is not None and cfg is not None:
        try:
            chat = use_chat_template(cfg.model.chat_template, tok)
        except ValueError:   # "on" without a template
            chat = False
            problems.append(f"model.chat_template 'on': the tokenizer in {path!r} has no chat template")
        if chat:
            try:
                encode_prompts(tok, [PROBE], chat=True)
            except Exception as e:  # noqa: BLE001 - jinja2's errors, and whatever the template raises itself
                problems.append(f"{where}: the chat template does not render a user turn ({_why(e)}; "
                                "fix it, or set model.chat_template 'off')")
            else:
                problems += _next_turn(tok, where, cfg.agent.turns)
    context = context_length(head) if head is not None else None
    if cfg is None or context is None:
        return problems
    if cfg.rollout.max_new_tokens >= context:
        problems.append(f"rollout.max_new_tokens {cfg.rollout.max_new_tokens} leaves no room for a prompt in the "
                        f"model's context of {context} tokens ({path}/config.json)")
    elif cfg.model.max_seq_len > context:
        problems.append(f"model.max_seq_len {cfg.model.max_seq_len} exceeds the model's context of {context} tokens "
                        f"({path}/config.json)")
    return problems


def _next_turn(tok, where: str, turns: int) -> list[str]:
    """With agent.turns > 1, the feedback on an answer goes in as a new user turn of the chat
    template (`chat_extension`), as the first multi-turn wave would append it."""
    from ratchet.rollout.episodes import chat_extension

    if turns < 2:
        return []
    try:
        chat_extension(tok, PROBE, "1 of 2 tests failed")
    except Exception as e:  # noqa: BLE001 - chat_extension's ValueError, jinja2's errors, the template's own
        return [f"{where}: agent.turns {turns}: the chat template cannot add a user turn after an answer "
                f"({_why(e)}; fix it, set model.chat_template 'off' or agent.turns 1)"]
    return []


def _weights(p: Path, where: str, head) -> list[str]:
    """The weights from_pretrained would read (the first of WEIGHTS present, its order): every shard
    a shard index names exists, each safetensors file's header reads, and the tensors it names make
    the model config.json describes (`_fit`; no tensor is loaded)."""
    from safetensors import safe_open

    from ratchet.model import weights_gap

    name = next((n for n in WEIGHTS if (p / n).is_file()), None)
    if name is None:
        return [f"{where}: no weights ({' or '.join(WEIGHTS[::2])})"]
    files = [name]
    if name.endswith(".index.json"):
        try:
            files = sorted(set(json.loads((p / name).read_text())["weight_map"].values()))
            if not files or not all(isinstance(f, str) for f in files):
                raise TypeError
        except (ValueError, OSError, KeyError, TypeError, AttributeError):
            return [f"{where}: {name} is not a shard index (JSON whose weight_map names the shard files)"]
        missing = [f for f in files if not (p / f).is_file()]
        if missing:
            return [f"{where}: {name} names {len(missing)} shard(s) not in the directory: {', '.join(missing[:3])}"]
    shapes = {}
    for f in files:
        if f.endswith(".safetensors"):
            try:
                with safe_open(str(p / f), framework="pt") as st:
                    shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
            except Exception as e:  # noqa: BLE001 - SafetensorError, OSError
                return [f"{where}: {f} is not a readable safetensors file ({_why(e)})"]
    pickled = not all(f.endswith(".safetensors") for f in files)   # no header to read without unpickling
    if head is None or pickled or getattr(head.config, "quantization_config", None):
        return []   # quantized tensors: only the quantizer maps them onto the model's
    try:
        gap = weights_gap(*_fit(head.config, shapes))
    except (ImportError, AttributeError, TypeError):   # transformers' internals moved (they are no public API):
        return []                                       # load_policy's check (output_loading_info) still refuses
    return [f"{where}: {gap}"] if gap else []


def _fit(config, shapes: dict[str, tuple]) -> tuple[set, set, set]:
    """The (missing, unexpected, mismatched) weights `from_pretrained(..., output_loading_info=True)`
    reports for files holding tensors of these names and shapes, found against a meta-device model of
    `config` (no memory) and with transformers' own rules: its key mapping (legacy names, the base
    model's prefix added or dropped; fused expert weights are matched by name only), tied weights
    (lm_head may be absent when its embeddings are there) and the model's ignore lists."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    from transformers.utils.loading_report import LoadStateDictInfo

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    mapping = get_model_conversion_mapping(model)
    renames, converters = ([m for m in mapping if isinstance(m, kind)] for kind in (WeightRenaming, WeightConverter))
    present, unexpected, mismatched = set(), set(), set()
    for key, shape in shapes.items():
        name, fused = rename_source_key(key, renames, converters, model.base_model_prefix, expected)
        if name not in expected and key in expected:   # as transformers: a model name is never renamed away
            name, fused = key, None
        if name not in expected:
            unexpected.add(key)
            continue
        present.add(name)
        if fused is None and expected[name] != shape:
            mismatched.add((name, shape, expected[name]))
    tied = {name for name, source in model.all_tied_weights_keys.items() if source in present}
    info = LoadStateDictInfo(missing_keys=set(expected) - present - tied, unexpected_keys=unexpected,
                             mismatched_keys=mismatched, error_msgs=[], conversion_errors={}, skipped_pp_keys=set())
    model._adjust_missing_and_unexpected_keys(info)
    return info.missing_keys, info.unexpected_keys, info.mismatched_keys


def _why(e: Exception) -> str:
    """The error's first sentence on one line: transformers' messages go on with pages of advice."""
    return f"{type(e).__name__}: {' '.join(str(e).split()).split('. ', 1)[0][:200]}"


@contextmanager
def _quiet():
    """transformers' log lines and warnings off while it reads a directory: each problem is one
    error line of ours, and stderr holds nothing else."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def _envs(cfg: NightlyConfig) -> list[str]:
    from envs.registry import get_family
    from ratchet.store import validate_key

    problems = []
    for fam in cfg.envs.families:
        try:
            get_family(fam)
        except KeyError as e:
            problems.append(f"envs.families: {str(e).strip(chr(34) + chr(39))}")
    if "/" in cfg.envs.version:
        problems.append(f"envs.version {cfg.envs.version!r}: one path component, no '/'")
    else:
        try:
            validate_key(f"envs/family/{cfg.envs.version}/tasks.parquet")
        except ValueError:
            problems.append(f"envs.version {cfg.envs.version!r}: not usable in a store key (no '.', '..' or NUL)")
    return problems


def _sources(cfg: NightlyConfig) -> list[str]:
    """Each task source can be read, imports at least one good task (bad lines are the run's to
    quarantine; a file with no good line is a problem now) and has tasks of both splits, before and
    after dedup and decontamination (`import_source`, as the run cleans it): the run gates each
    source's audited train and held-out tables as non-empty, after auditing them all."""
    from envs.sources import SourceError, import_source, read_source

    problems = []
    for source in cfg.envs.sources:
        try:
            if source.startswith("s3://"):
                if not source.startswith(cfg.store.uri.rstrip("/") + "/"):
                    problems.append(f"envs.sources: task source {source!r}: an s3:// source must lie in the run's "
                                    f"store ({cfg.store.uri})")
                continue
            # parsed, split and cleaned as the run will: each split's tasks before ("imported") and after ("kept")
            counts = import_source(source, read_source(source), cfg.envs).production.lineage["counts"]
            splits = (("heldout", "held-out", "train"), ("train", "training", "heldout"))
            unsplit = [f"envs.sources: task source {source!r} has no {what} tasks (every task's split is {other}: a "
                       f"line's own \"split\", else 1 task id in 10 held out by a hash; give some lines \"split\": "
                       f"\"{split}\")" for split, what, other in splits if not counts[split]["imported"]]
            problems += unsplit
            for split, what, _ in splits if not unsplit else ():
                c = counts[split]
                if not c["kept"]:
                    problems.append(
                        f"envs.sources: task source {source!r} has no {what} task left after cleaning: of "
                        f"{c['imported']}, {c['exact_duplicates']} exact and {c['near_duplicates']} near duplicates"
                        + (f", {c['contaminated']} sharing their prompts with held-out ones" if "contaminated" in c else "")
                        + " (envs.clean sets the thresholds)")
        except SourceError as e:
            problems.append(f"envs.sources: {e}")
    return problems
