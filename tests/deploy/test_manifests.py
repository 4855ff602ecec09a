"""deploy/ agrees with itself: one set of work-pool names in prefect.yaml, docker-compose,
k8s and the README, a worker for every pool in each, the settings every worker needs, a GPU
for the trainer, an image that carries no local environment or store, an egress policy that lets
the workers reach the Prefect API, the store and DNS, and DeepSpeed launcher commands in the docs
that DeepSpeed's launcher accepts."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PREFECT = yaml.safe_load((DEPLOY / "prefect.yaml").read_text())
POOLS = {d["work_pool"]["name"] for d in PREFECT["deployments"]}
COMPOSE = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
K8S = [doc for path in sorted((DEPLOY / "k8s").glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]
WORKER_SETTINGS = {"PREFECT_API_URL", "RATCHET_HOME", "RATCHET_S3_ENDPOINT", "RATCHET_S3_SECURE"}
POOL_ARG = re.compile(r"(?:--pool|work-pool create)['\",\s]+([A-Za-z0-9_-]+)")   # also `"--pool", "x"` in a list
LIMIT_ARG = re.compile(r"--limit['\",\s]+(\d+)")


def _pool(command: str | list[str]) -> str | None:
    found = POOL_ARG.findall(command if isinstance(command, str) else " ".join(command))
    return found[0] if found else None


def _compose_workers() -> dict[str, dict]:
    return {_pool(s["command"]): s for s in COMPOSE.values() if "worker start" in str(s.get("command"))}


def _k8s_workers() -> dict[str, dict]:
    out = {}
    for doc in K8S:
        if doc["kind"] == "Deployment":
            [container] = doc["spec"]["template"]["spec"]["containers"]
            out[_pool(container["command"])] = doc
    return out


def test_one_pool_naming_everywhere():
    assert POOLS == {"ratchet-cpu", "ratchet-trainer"}
    readme = (DEPLOY / "README.md").read_text()
    named = {
        "docker-compose.yml": set(POOL_ARG.findall((DEPLOY / "docker-compose.yml").read_text())),
        "k8s": {p for path in (DEPLOY / "k8s").glob("*.yaml") for p in POOL_ARG.findall(path.read_text())},
        "README.md": set(POOL_ARG.findall(readme)),
    }
    assert {where: pools for where, pools in named.items() if pools != POOLS} == {}
    assert set(_compose_workers()) == POOLS and set(_k8s_workers()) == POOLS   # a worker for every pool
    for pool in POOLS:   # the README starts a worker for each pool, and says what runs there
        assert re.search(rf"worker start --pool {pool}\b", readme), pool


def test_every_worker_has_its_settings():
    for pool, service in _compose_workers().items():
        assert WORKER_SETTINGS | {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(service["environment"]), pool
        assert service["environment"]["RATCHET_HOME"] == "/opt/ratchet", pool
    config = {doc["metadata"]["name"]: doc["data"] for doc in K8S if doc["kind"] == "ConfigMap"}
    for pool, deployment in _k8s_workers().items():
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        env = {}
        for source in container["envFrom"]:
            if "configMapRef" in source:
                env.update(config[source["configMapRef"]["name"]])
        assert WORKER_SETTINGS <= set(env) and env["RATCHET_HOME"] == "/opt/ratchet", pool
        assert any("secretRef" in source for source in container["envFrom"]), pool   # the S3 credentials
    assert "ENV RATCHET_HOME=/opt/ratchet" in (DEPLOY / "Dockerfile").read_text()
    assert "WORKDIR /opt/ratchet" in (DEPLOY / "Dockerfile").read_text()


def test_the_trainer_gets_a_gpu_and_the_cpu_workers_the_sandbox_runtime():
    [device] = _compose_workers()["ratchet-trainer"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and device["count"] >= 1
    assert "deploy" not in _compose_workers()["ratchet-cpu"]
    trainer = _k8s_workers()["ratchet-trainer"]["spec"]["template"]["spec"]
    assert trainer["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] >= 1
    cpu = _k8s_workers()["ratchet-cpu"]["spec"]["template"]["spec"]
    [runtime] = [doc for doc in K8S if doc["kind"] == "RuntimeClass"]
    assert cpu["runtimeClassName"] == runtime["metadata"]["name"]


def test_a_trainer_worker_runs_one_flow_run_at_a_time():
    """One flow run per trainer worker (its GPU): `--limit 1` on every trainer worker command, in
    compose, k8s and the README; the cpu workers run as many as they like."""
    def limits(command: str | list[str]) -> list[str]:
        return LIMIT_ARG.findall(command if isinstance(command, str) else " ".join(command))

    trainer = _k8s_workers()["ratchet-trainer"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert limits(_compose_workers()["ratchet-trainer"]["command"]) == ["1"]
    assert limits(trainer) == ["1"]
    assert limits(_compose_workers()["ratchet-cpu"]["command"]) == []
    readme = (DEPLOY / "README.md").read_text()
    started = re.findall(r"worker start --pool ratchet-trainer\b[^\n`]*", readme)
    assert started and all(limits(line) == ["1"] for line in started), started


def _allows(rule: dict, protocol: str, port: int) -> bool:
    return any(p.get("protocol", "TCP") == protocol and p["port"] == port for p in rule.get("ports", []))


def test_the_workers_egress_policy_lets_them_reach_the_api_the_store_and_dns():
    """The policy selects both workers' pods and allows, on the ports the ConfigMap's URLs name,
    the Prefect server pods as the prefect-server Helm chart labels them (PrefectHQ/prefect-helm:
    `app.kubernetes.io/name: prefect-server`, component `server`; an `app: prefect-server`
    selector matched nothing there), MinIO, and DNS over UDP and TCP."""
    [policy] = [doc for doc in K8S if doc["kind"] == "NetworkPolicy"]
    selector = policy["spec"]["podSelector"]
    [expression] = selector["matchExpressions"]
    for deployment in _k8s_workers().values():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert expression["operator"] == "In" and labels[expression["key"]] in expression["values"], labels
    [config] = [doc["data"] for doc in K8S if doc["kind"] == "ConfigMap"]
    api_port = int(re.fullmatch(r"https?://[^:/]+:(\d+)/api", config["PREFECT_API_URL"]).group(1))
    s3_port = int(config["RATCHET_S3_ENDPOINT"].rsplit(":", 1)[1])
    egress = policy["spec"]["egress"]

    def peers(protocol: str, port: int) -> list[dict]:
        return [peer.get("podSelector", {}).get("matchLabels", {}) for rule in egress if _allows(rule, protocol, port)
                for peer in rule["to"]]

    assert {"app.kubernetes.io/name": "prefect-server", "app.kubernetes.io/component": "server"} in peers("TCP", api_port)
    assert {"app": "minio"} in peers("TCP", s3_port)
    assert {"k8s-app": "kube-dns"} in peers("UDP", 53) and {"k8s-app": "kube-dns"} in peers("TCP", 53)
    assert all(rule.get("ports") for rule in egress)          # no rule opens every port
    assert policy["spec"]["ingress"] == [] and "Ingress" in policy["spec"]["policyTypes"]


def test_compose_registers_the_deployments_before_the_workers_start():
    register = COMPOSE["register"]
    command = " ".join(register["command"])
    assert "deploy --prefect-file deploy/prefect.yaml --all" in command
    assert set(POOL_ARG.findall(command)) == POOLS
    for service in _compose_workers().values():
        assert service["depends_on"]["register"] == {"condition": "service_completed_successfully"}


def test_the_image_carries_no_local_environment_store_or_history():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".venv", ".ratchet", ".git"} <= ignored


# a `deepspeed` launcher command in deploy/*.md (after joining `\` continuations), up to a comment or a closing backtick
DEEPSPEED_COMMAND = re.compile(r"(?<![\w./-])deepspeed[ \t]+(-[^`\n#]*)")


def _deepspeed_commands() -> list[tuple[str, str]]:
    return [(path.name, m.group(1).strip()) for path in sorted(DEPLOY.glob("*.md"))
            for m in DEEPSPEED_COMMAND.finditer(path.read_text().replace("\\\n", " "))]


def test_deepspeed_commands_in_the_docs_are_ones_its_launcher_accepts():
    """DeepSpeed's launcher takes `--module NAME`; `-m` (torchrun's and python's spelling) stops it
    with `unrecognized arguments: -m`. Each command is parsed by the launcher's own argparse
    where DeepSpeed is installed; the spelling is checked everywhere."""
    commands = _deepspeed_commands()
    assert len(commands) >= 5, commands   # README.md 2, deepspeed.md 3
    assert [(where, c) for where, c in commands if "-m" in shlex.split(c)] == []
    assert [(where, c) for where, c in commands if "--module ratchet.train.launch" not in c] == []
    try:
        from deepspeed.launcher.runner import parse_args
    except ImportError:
        return
    for where, command in commands:
        try:
            args = parse_args(shlex.split(command))
        except SystemExit:
            pytest.fail(f"{where}: DeepSpeed's launcher refuses `deepspeed {command}`")
        assert args.module and args.user_script == "ratchet.train.launch", (where, command)
