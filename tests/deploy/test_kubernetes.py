"""deploy/kubernetes/ holds valid Kubernetes objects that run what the README promises.

No cluster runs here. Every document of every manifest is validated against the
Kubernetes API's schemas that ``kubernetes_validate`` bundles (no network: it
resolves every reference from its own files), in strict mode, where a field the
API does not know is an error rather than silently dropped. Kustomize's own file
is not an API object; the test checks that it lists every manifest. What the
schemas cannot know is checked against the code: Services select the pods they
serve, the commands and probes are ``relaunch`` commands with options it takes,
and every variable is a setting the process reads and accepts.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import typer.main
import yaml
from cryptography.fernet import Fernet
from pydantic_settings import BaseSettings
from typer.core import TyperGroup

from service.api.health import router as health_router
from service.cli import app
from service.settings import ControllerSettings
from tests.deploy.compose import ROOT
from worker.settings import AgentSettings, read_token_file

MANIFESTS = ROOT / "deploy" / "kubernetes"
KUSTOMIZATION = "kustomization.yaml"
EXAMPLE_SECRETS = "secrets.example.yaml"  # documentation: real secrets are made with kubectl
# The oldest release the manifests are meant for (Pod Security admission labels, the
# namespace's kubernetes.io/metadata.name label), and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.latest_version())
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
AGENT_CAPABILITIES = {"CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL", "SETGID", "SETUID"}


def load_documents(path: Path) -> list[dict[str, Any]]:
    """The YAML documents of ``path`` that hold something, as the API server reads them."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifest_files() -> list[Path]:
    return sorted(p for p in MANIFESTS.glob("*.yaml") if p.name != KUSTOMIZATION)


def all_resources() -> list[dict[str, Any]]:
    return [doc for path in manifest_files() for doc in load_documents(path)]


def find(kind: str, name: str) -> dict[str, Any]:
    found = [r for r in all_resources() if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def only_container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1, workload["metadata"]["name"]
    container: dict[str, Any] = containers[0]
    return container


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


CONTROLLER = "relaunch-controller"
AGENT = "relaunch-agent"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_every_manifest_is_valid_against_the_kubernetes_api(path: Path, version: str) -> None:
    documents = load_documents(path)
    assert documents, f"{path.name} holds no object"
    for resource in documents:
        kubernetes_validate.validate(resource, version, strict=True)


@pytest.mark.parametrize(
    ("good", "bad"),
    [
        ("    spec:\n      # It never", "    spec:\n      contianers: []\n      # It never"),
        ("readOnlyRootFilesystem: true", "readOnlyRootFilesytem: true"),
        ("containerPort: 8080", "containerPort: eighty"),
    ],
)
def test_the_validation_refuses_a_broken_manifest(tmp_path: Path, good: str, bad: str) -> None:
    """A misspelt field, even an optional one that a lenient reader would drop, fails."""
    text = (MANIFESTS / "controller.yaml").read_text()
    assert text.count(good) == 1
    broken = tmp_path / "controller.yaml"
    broken.write_text(text.replace(good, bad))
    deployment = load_documents(broken)[0]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


def test_the_kustomization_lists_every_manifest_but_the_example_secrets() -> None:
    kustomization = load_documents(MANIFESTS / KUSTOMIZATION)[0]
    assert kustomization["kind"] == "Kustomization"
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in manifest_files()} - {EXAMPLE_SECRETS}
    namespaces = [r for r in all_resources() if r["kind"] == "Namespace"]
    assert [n["metadata"]["name"] for n in namespaces] == [kustomization["namespace"]]
    # Whatever image the kustomization names, the workloads' `image: relaunch` is its target.
    targets = {image["name"] for image in kustomization["images"]}
    for kind, name in (("Deployment", CONTROLLER), ("StatefulSet", AGENT)):
        assert only_container(find(kind, name))["image"] in targets


def test_every_selector_selects_the_pods_it_serves() -> None:
    resources = all_resources()
    workloads = [r for r in resources if r["kind"] in WORKLOAD_KINDS]
    pod_labels = {
        w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in workloads
    }
    for workload in workloads:
        assert selects(
            workload["spec"]["selector"]["matchLabels"], pod_labels[workload["metadata"]["name"]]
        )
    for service in (r for r in resources if r["kind"] == "Service" and "selector" in r["spec"]):
        chosen = [
            name
            for name, labels in pod_labels.items()
            if selects(service["spec"]["selector"], labels)
        ]
        assert chosen == [service["metadata"]["name"]], (service["metadata"]["name"], chosen)
        container = only_container(next(w for w in workloads if w["metadata"]["name"] == chosen[0]))
        named_ports = {p["name"] for p in container.get("ports", [])}
        for port in service["spec"].get("ports", []):
            assert port["targetPort"] in named_ports, service["metadata"]["name"]
    agents = find("StatefulSet", AGENT)
    governing = find("Service", agents["spec"]["serviceName"])
    assert governing["spec"]["clusterIP"] == "None"
    for policy in (r for r in resources if r["kind"] == "NetworkPolicy"):
        selectors = [policy["spec"]["podSelector"]["matchLabels"]]
        for rule in policy["spec"].get("ingress", []) + policy["spec"].get("egress", []):
            peers = rule.get("from", []) + rule.get("to", [])
            selectors += [p["podSelector"]["matchLabels"] for p in peers if "podSelector" in p]
        for selector in selectors:
            assert any(selects(selector, labels) for labels in pod_labels.values()), (
                policy["metadata"]["name"],
                selector,
            )


def _parses(command: list[str]) -> None:
    """``command`` is ``relaunch SUBCOMMAND [OPTIONS]`` that the CLI accepts (not run)."""
    assert command[0] == "relaunch", command
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    subcommand = group.commands.get(command[1])
    assert subcommand is not None, f"relaunch has no command {command[1]!r}"
    subcommand.make_context(command[1], list(command[2:]))  # raises on an unknown option


def test_the_commands_and_probes_are_relaunch_commands() -> None:
    controller = only_container(find("Deployment", CONTROLLER))
    agent = only_container(find("StatefulSet", AGENT))
    assert controller["command"] == ["relaunch", "server"]
    assert agent["command"] == ["relaunch", "agent"]
    for container in (controller, agent):
        _parses(container["command"])
    # An agent is healthy when its loop turns: only `relaunch healthcheck` can tell.
    for probe in ("startupProbe", "livenessProbe"):
        command = agent[probe]["exec"]["command"]
        assert command == ["relaunch", "healthcheck", "--role", "agent"]
        _parses(command)
    # A controller is healthy when /healthz answers, which is all `relaunch healthcheck
    # --role controller` asks; the kubelet asks it directly.
    routes = {getattr(route, "path", None) for route in health_router.routes}
    api_port = {p["name"]: p["containerPort"] for p in controller["ports"]}["api"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = controller[probe]["httpGet"]
        assert check["path"] in routes
        assert check["port"] == "api"
    assert str(api_port) == plain_env(controller)["RELAUNCH_PORT"]


def plain_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


EXAMPLE_SECRET_VALUES = {
    ("relaunch-controller", "database-url"): "postgresql://relaunch:pw@relaunch-postgres/relaunch",
    ("relaunch-controller", "secrets-keys"): Fernet.generate_key().decode(),
    ("relaunch-controller", "metrics-token"): "m" * 32,
    ("relaunch-enrolment", "token"): "e" * 32,
}
EXAMPLE_FIELD_VALUES = {"metadata.name": "relaunch-agent-0", "status.podIP": "10.0.0.7"}


def resolved_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet would give it, from example values."""
    env = {}
    for entry in container["env"]:
        source = entry.get("valueFrom", {})
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[entry["name"]] = EXAMPLE_SECRET_VALUES[(ref["name"], ref["key"])]
        else:
            env[entry["name"]] = EXAMPLE_FIELD_VALUES[source["fieldRef"]["fieldPath"]]
    return env


def project_secret_file(directory: Path, key: str, value: str, mode: int) -> Path:
    """Write ``key`` the way the kubelet projects a Secret volume: ``key`` is a link to
    ``..data/key``, ``..data`` a link to a timestamped directory holding the file."""
    payload = directory / "..2026_11_24_02_00_00.000000001"
    payload.mkdir(parents=True)
    (payload / key).write_text(value)
    (payload / key).chmod(mode)
    (directory / "..data").symlink_to(payload.name)
    (directory / key).symlink_to(f"..data/{key}")
    return directory / key


def enrolment_token_file(agents: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The token file's path in the agent container, and the Secret volume behind it."""
    container = only_container(agents)
    path = plain_env(container)["RELAUNCH_AGENT_ENROLMENT_TOKEN_FILE"]
    for mount in container["volumeMounts"]:
        volume = next(v for v in pod_spec(agents)["volumes"] if v["name"] == mount["name"])
        if "secret" in volume and path.startswith(mount["mountPath"] + "/"):
            return path.removeprefix(mount["mountPath"] + "/"), volume["secret"]
    raise AssertionError(f"{path} is in no Secret volume of the agents")


@pytest.mark.parametrize(
    ("kind", "name", "settings_class"),
    [("Deployment", CONTROLLER, ControllerSettings), ("StatefulSet", AGENT, AgentSettings)],
)
def test_every_variable_is_a_setting_the_process_knows_and_accepts(
    kind: str,
    name: str,
    settings_class: type[BaseSettings],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A renamed or misspelt setting would be ignored in silence; a bad value stops the pod."""
    workload = find(kind, name)
    env = resolved_env(only_container(workload))
    prefix = settings_class.model_config["env_prefix"]
    known = {f"{prefix}{field}".upper() for field in settings_class.model_fields}
    if settings_class is ControllerSettings:
        known.add("DATABASE_URL")
    assert set(env) <= known, f"{name}: unknown settings {set(env) - known}"
    token_file = env.get("RELAUNCH_AGENT_ENROLMENT_TOKEN_FILE")
    if token_file is not None:  # the same file, projected under tmp_path
        key, secret = enrolment_token_file(workload)
        value = EXAMPLE_SECRET_VALUES[(secret["secretName"], key)]
        projected = project_secret_file(tmp_path, key, value, secret["defaultMode"])
        env["RELAUNCH_AGENT_ENROLMENT_TOKEN_FILE"] = str(projected)
    for variable in [v for v in os.environ if v.startswith("RELAUNCH_") or v == "DATABASE_URL"]:
        monkeypatch.delenv(variable)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    settings_class()  # validates, from the environment


def test_the_agent_accepts_its_token_file_as_the_kubelet_projects_it(tmp_path: Path) -> None:
    agents = find("StatefulSet", AGENT)
    key, secret = enrolment_token_file(agents)
    assert secret["items"] == [{"key": key, "path": key}]
    mode = secret["defaultMode"]
    assert mode & (stat.S_IRWXG | stat.S_IRWXO) == 0, f"{mode:o}"
    token = project_secret_file(tmp_path / "ok", key, "t" * 32, mode)
    assert token.is_symlink()
    assert read_token_file(token) == "t" * 32
    # An fsGroup makes the kubelet add group read to a Secret's files; the agent refuses that.
    group_readable = project_secret_file(tmp_path / "fsgroup", key, "t" * 32, mode | 0o040)
    with pytest.raises(ValueError, match="open to group or others"):
        read_token_file(group_readable)
    assert "fsGroup" not in pod_spec(agents).get("securityContext", {})


def dockerfile_uid() -> int:
    match = re.search(r"useradd .*--uid (\d+)", (ROOT / "Dockerfile").read_text())
    assert match is not None
    return int(match.group(1))


def test_the_controller_runs_unprivileged_on_a_read_only_root() -> None:
    controller = find("Deployment", CONTROLLER)
    pod = pod_spec(controller)["securityContext"]
    assert pod["runAsNonRoot"] is True
    assert pod["runAsUser"] == pod["runAsGroup"] == dockerfile_uid()
    container = only_container(controller)
    context = container["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["readOnlyRootFilesystem"] is True
    # What it may write is mounted: its data dir and /tmp.
    env = plain_env(container)
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    assert {env["RELAUNCH_DATA_DIR"], "/tmp"} <= mounted
    # It makes the snapshot root at start if missing, which a read-only root refuses: the
    # image holds it already.
    made = rf"install -d .* {re.escape(env['RELAUNCH_SNAPSHOT_ROOT'])}$"
    assert re.search(made, (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert pod_spec(controller)["automountServiceAccountToken"] is False


def test_the_agent_is_root_with_only_the_capabilities_of_user_isolation() -> None:
    agents = find("StatefulSet", AGENT)
    container = only_container(agents)
    assert plain_env(container)["RELAUNCH_AGENT_ISOLATION"] == "user"
    context = container["securityContext"]
    assert context["runAsUser"] == 0
    assert context["privileged"] is False
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    assert set(context["capabilities"]["add"]) == AGENT_CAPABILITIES
    assert pod_spec(agents)["automountServiceAccountToken"] is False
    # Pod Security "baseline" admits these capabilities; "restricted" would refuse root.
    namespace = next(r for r in all_resources() if r["kind"] == "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "baseline"


def test_the_agents_share_the_snapshot_volume_at_the_controllers_snapshot_root() -> None:
    root = plain_env(only_container(find("Deployment", CONTROLLER)))["RELAUNCH_SNAPSHOT_ROOT"]
    agents = find("StatefulSet", AGENT)
    mount = next(m for m in only_container(agents)["volumeMounts"] if m["mountPath"] == root)
    volume = next(v for v in pod_spec(agents)["volumes"] if v["name"] == mount["name"])
    claim = find("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_agents_reach_the_controller_service_and_only_agents_reach_agents() -> None:
    url = plain_env(only_container(find("StatefulSet", AGENT)))["RELAUNCH_AGENT_CONTROLLER_URL"]
    service = find("Service", CONTROLLER)
    assert url == f"http://{CONTROLLER}:{service['spec']['ports'][0]['port']}"
    agent_labels = find("StatefulSet", AGENT)["spec"]["template"]["metadata"]["labels"]
    agent_policy = find("NetworkPolicy", AGENT)["spec"]
    assert "Ingress" in agent_policy["policyTypes"]
    for rule in agent_policy["ingress"]:
        assert rule["from"] == [{"podSelector": {"matchLabels": agent_labels}}]
    controller_policy = find("NetworkPolicy", CONTROLLER)["spec"]
    api_port = only_container(find("Deployment", CONTROLLER))["ports"][0]["containerPort"]
    assert [rule["ports"] for rule in controller_policy["ingress"]] == [
        [{"protocol": "TCP", "port": api_port}]
    ]


def test_the_database_is_named_by_the_external_service() -> None:
    database = find("Service", "relaunch-postgres")
    assert database["spec"]["type"] == "ExternalName"
    example = find("Secret", "relaunch-controller")["stringData"]["database-url"]
    assert f"@{database['metadata']['name']}:" in example
