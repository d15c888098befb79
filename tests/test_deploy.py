"""deploy/, checked without a container engine or a cluster: the compose file and the Kubernetes
manifests parse, have the shape the README describes, and every kvserve flag and KVSERVE_* variable
they name is a real setting; every smg flag is one the pinned smg knows."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from conftest import kvserve_help, names_flag
from kvserve.config import Settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
KUBERNETES = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
SMG_IMAGE = "lightseekorg/smg:"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def manifests() -> list[dict]:
    assert KUBERNETES, "no manifests in deploy/kubernetes"
    return [doc for path in KUBERNETES for doc in yaml.safe_load_all(path.read_text()) if doc]


def _one(manifests: list[dict], kind: str, name: str) -> dict:
    found = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _flags(args: list[str]) -> list[str]:
    return [a.split("=")[0] for a in args if a.startswith("--")]


def _value(args: list[str], flag: str) -> list[str]:
    """The values after `flag`, up to the next flag."""
    start = args.index(flag) + 1
    end = next((i for i in range(start, len(args)) if args[i].startswith("--")), len(args))
    return args[start:end]


def _replicas(compose: dict) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items() if s["image"].startswith("kvserve:")}


def _kvserve_commands(compose: dict, manifests: list[dict]) -> list[list[str]]:
    k8s = _container(_one(manifests, "Deployment", "kvserve"))["args"]
    return [s["command"] for s in _replicas(compose).values()] + [k8s]


def _smg_commands(compose: dict, manifests: list[dict]) -> list[list[str]]:
    return [compose["services"]["router"]["command"], _container(_one(manifests, "Deployment", "smg"))["args"]]


def test_compose_runs_smg_over_two_replicas_sharing_one_model_volume(compose: dict) -> None:
    replicas = _replicas(compose)
    assert len(replicas) == 2
    for replica in replicas.values():
        assert replica["volumes"] == ["models:/models:ro"]
        assert _value(replica["command"], "--model")[0].startswith("/models/")
    assert set(compose["volumes"]) == {"models"}

    router = compose["services"]["router"]
    assert router["image"].startswith(SMG_IMAGE)
    args = router["command"]
    assert _value(args, "--policy") == ["cache_aware"]
    assert sorted(_value(args, "--worker-urls")) == sorted(f"http://{name}:8000" for name in replicas)
    assert router["depends_on"] == {name: {"condition": "service_healthy"} for name in replicas}


def test_kubernetes_replicas_behind_a_headless_service_and_smg(manifests: list[dict]) -> None:
    replicas = _one(manifests, "Deployment", "kvserve")
    labels = replicas["spec"]["template"]["metadata"]["labels"]
    assert replicas["spec"]["selector"]["matchLabels"] == labels
    container = _container(replicas)
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    claim = replicas["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert "ReadOnlyMany" in _one(manifests, "PersistentVolumeClaim", claim)["spec"]["accessModes"]

    service = _one(manifests, "Service", "kvserve")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == labels

    router = _one(manifests, "Deployment", "smg")
    args = _container(router)["args"]
    assert _value(args, "--policy") == ["cache_aware"]
    selector = dict(pair.split("=", 1) for pair in _value(args, "--selector"))
    assert selector.items() <= labels.items(), "smg's selector does not match the replica pods"
    assert _value(args, "--service-discovery-port") == [str(container["ports"][0]["containerPort"])]
    account = router["spec"]["template"]["spec"]["serviceAccountName"]
    binding = _one(manifests, "RoleBinding", "smg-pod-reader")
    assert binding["subjects"][0]["name"] == account
    rules = _one(manifests, "Role", binding["roleRef"]["name"])["rules"]
    assert {"get", "list", "watch"} <= {verb for rule in rules if "pods" in rule["resources"] for verb in rule["verbs"]}
    assert _one(manifests, "Service", "smg")["spec"]["selector"] == router["spec"]["template"]["metadata"]["labels"]


def test_every_kvserve_flag_and_variable_named_is_a_setting(compose: dict, manifests: list[dict]) -> None:
    help_text = kvserve_help()
    for command in _kvserve_commands(compose, manifests):
        for flag in _flags(command):
            field = flag.removeprefix("--").removeprefix("no-").replace("-", "_")
            assert field in Settings.model_fields, f"{flag} is no kvserve setting"
            assert names_flag(help_text, flag), f"kvserve --help does not list {flag}"
    for path in [COMPOSE, *KUBERNETES]:
        for var in re.findall(r"\bKVSERVE_([A-Z0-9_]+)", path.read_text()):
            assert var.lower() in Settings.model_fields, f"KVSERVE_{var} is no setting"


def _test_extra_pin(package: str) -> str:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    pins = [m[1] for dep in extra if (m := re.fullmatch(rf"\s*{re.escape(package)}\s*==\s*(\S+)\s*", dep))]
    assert len(pins) == 1, f"the test extra does not pin {package} exactly"
    return pins[0]


def test_router_images_are_the_tested_smg(compose: dict, manifests: list[dict]) -> None:
    images = {compose["services"]["router"]["image"], _container(_one(manifests, "Deployment", "smg"))["image"]}
    assert images == {SMG_IMAGE + _test_extra_pin("smg")}


def test_every_smg_flag_named_is_one_smg_knows(compose: dict, manifests: list[dict]) -> None:
    if importlib.util.find_spec("smg") is None:
        pytest.skip("smg is not installed (pip install -e '.[test]' installs it)")
    # The image's entrypoint: python3 -m smg.launch_router
    result = subprocess.run([sys.executable, "-m", "smg.launch_router", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    for command in _smg_commands(compose, manifests):
        for flag in _flags(command):
            assert names_flag(result.stdout, flag), f"smg does not know {flag}"
