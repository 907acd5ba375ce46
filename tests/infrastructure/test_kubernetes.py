"""deploy/kubernetes/, checked without a cluster.

The kustomization is rendered here (it is kept to `resources` and one
strategic-merge patch, which this file applies itself), and every resource is
validated against the Kubernetes schemas that the pinned kubernetes-validate
package ships, in strict mode (a misspelt field fails). The Prometheus Operator's
ServiceMonitor is a CRD the core schemas lack: its fields are checked by hand.

Then everything the manifests take from the server is checked against the
server: every command line parses with the real `whisper-triton` parser, every
port is the one the server listens on, every probe path is one Triton's client
library or the gateway's FastAPI app serves, every metric the autoscaler reads
is one python_backend_lib/serving/metrics.py publishes, and the shutdown's time budget
covers the launcher's drain.
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.util
import re
import urllib.parse
from pathlib import Path
from types import SimpleNamespace

import kubernetes_validate
import pytest
import yaml

from python_backend_lib.apps import server
from python_backend_lib.apps.server import STOP_GRACE_S, ServerSettings, TritonServer
from python_backend_lib.apps.server_watch import DRAIN_TIMEOUT_S
from python_backend_lib.core.cache import CACHE_ENV
from python_backend_lib.serving.settings import CHECKPOINT_ENV
from whisper_triton.cli import build_parser

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy" / "kubernetes"
ADAPTER = DEPLOY / "prometheus-adapter"
TIMINGS = DEPLOY / "timings.yaml"
# The whisper model's Prometheus metrics, read as source (not run).
METRICS_MODULE = "python_backend_lib.serving.metrics"
DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DOC = REPO_ROOT / "docs" / "kubernetes.md"

# The oldest and the newest Kubernetes whose schemas kubernetes-validate 1.37.0 ships.
KUBERNETES_VERSIONS = ("1.32", "1.37")
DEPLOYMENT = "whisper-triton"
TRITON, GATEWAY, FLASHINFER_INIT = "triton", "gateway", "flashinfer-kernels"
GPU = "nvidia.com/gpu"
# FlashInfer's own variable (flashinfer/jit/env.py): where its JIT workspace lives.
FLASHINFER_ENV = "FLASHINFER_WORKSPACE_BASE"
# A queue the engine keeps and Triton's nv_inference_queue_* do not see.
QUEUE_METRICS = {"whisper_waiting_windows", "whisper_queue_wait_seconds"}
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")
PROBE_TIMINGS = {"initialDelaySeconds", "periodSeconds", "timeoutSeconds", "failureThreshold", "successThreshold"}
# Kubernetes' defaults where a probe leaves them out.
PROBE_DEFAULTS = {"initialDelaySeconds": 0, "periodSeconds": 10, "timeoutSeconds": 1, "failureThreshold": 3}


# --- rendering the kustomization ------------------------------------------------------

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches"}
# Strategic-merge patch: the lists merged item by item, by this key (Kubernetes'
# patchMergeKey for each); any other list is replaced whole.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "ports": "containerPort",
    "volumeMounts": "mountPath",
}


def load_documents(path: Path) -> list[dict]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document is not None]


def read_kustomization(directory: Path) -> dict:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    unknown = set(kustomization) - KUSTOMIZATION_KEYS
    assert not unknown, f"{directory}: this test renders only {sorted(KUSTOMIZATION_KEYS)}, not {sorted(unknown)}"
    for entry in kustomization["resources"]:
        assert (directory / entry).is_file(), f"{directory}: resource {entry!r} is not a file here"
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"path"}, f"{directory}: a patch is a file named by `path` alone, not {patch}"
        assert (directory / patch["path"]).is_file(), patch
    return kustomization


def strategic_merge(base: dict, patch: dict) -> None:
    for key, value in patch.items():
        assert not key.startswith("$"), f"patch directive {key!r}: not rendered by this test"
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            strategic_merge(base[key], value)
        elif isinstance(value, list) and key in MERGE_KEYS and isinstance(base.get(key), list):
            by_key = {item[MERGE_KEYS[key]]: item for item in base[key]}
            for item in value:
                if item[MERGE_KEYS[key]] in by_key:
                    strategic_merge(by_key[item[MERGE_KEYS[key]]], item)
                else:
                    base[key].append(copy.deepcopy(item))
        else:
            base[key] = copy.deepcopy(value)


def render(directory: Path) -> list[dict]:
    """What `kubectl kustomize directory` gives for a kustomization of resources and patches."""
    kustomization = read_kustomization(directory)
    resources = [document for entry in kustomization["resources"] for document in load_documents(directory / entry)]
    for patch_entry in kustomization.get("patches", []):
        for patch in load_documents(directory / patch_entry["path"]):
            targets = [
                r for r in resources if (r["kind"], r["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"])
            ]
            assert len(targets) == 1, (
                f"patch {patch_entry['path']}: no single {patch['kind']}/{patch['metadata']['name']}"
            )
            strategic_merge(targets[0], patch)
    return resources


@pytest.fixture(scope="module")
def resources() -> list[dict]:
    return render(DEPLOY)


@pytest.fixture(scope="module")
def adapter_resources() -> list[dict]:
    return render(ADAPTER)


def one(resources: list[dict], kind: str, name: str | None = None) -> dict:
    found = [r for r in resources if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def deployment(resources) -> dict:
    return one(resources, "Deployment", DEPLOYMENT)


@pytest.fixture(scope="module")
def pod(deployment) -> dict:
    return deployment["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def containers(pod) -> dict[str, dict]:
    return {c["name"]: c for c in pod["containers"]}


def parse_command(container: dict) -> argparse.Namespace:
    """The container's command line, through the real `whisper-triton` argument parser."""
    program, *arguments = container["command"] + container.get("args", [])
    assert program == "whisper-triton", container["command"]
    try:
        return build_parser().parse_args(arguments)
    except SystemExit:
        pytest.fail(f"{container['name']}: the whisper-triton parser rejects {arguments} (its error is above)")


@pytest.fixture(scope="module")
def serve(containers) -> argparse.Namespace:
    return parse_command(containers[TRITON])


@pytest.fixture(scope="module")
def gateway_options(containers) -> argparse.Namespace:
    return parse_command(containers[GATEWAY])


# --- the schemas ----------------------------------------------------------------------


def is_core(resource: dict) -> bool:
    return not resource["apiVersion"].startswith("monitoring.coreos.com/")


def schema_errors(resource: dict, version: str) -> str | None:
    try:
        kubernetes_validate.validate(resource, version, strict=True)
    except kubernetes_validate.ValidationError as error:
        path = "/".join(map(str, error.absolute_path)) or "<root>"
        return f"{resource['kind']}/{resource['metadata']['name']}: {path}: {error.message}"
    return None


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_resource_follows_the_kubernetes_schema(resources, adapter_resources, version):
    core = [r for r in resources + adapter_resources if is_core(r)]
    assert {r["kind"] for r in core} >= {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ConfigMap",
    }
    errors = [e for e in (schema_errors(r, version) for r in core) if e]
    assert not errors, "\n".join(errors)


def test_the_schema_catches_a_mistake(deployment):
    """The check above is not vacuous: a misspelt field fails it."""
    broken = copy.deepcopy(deployment)
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["livenesProbe"] = container.pop("livenessProbe")
    assert schema_errors(broken, KUBERNETES_VERSIONS[0])


def test_the_kustomizations_list_every_manifest():
    for directory in (DEPLOY, ADAPTER):
        kustomization = read_kustomization(directory)
        listed = set(kustomization["resources"]) | {p["path"] for p in kustomization.get("patches", [])}
        on_disk = {p.name for p in directory.glob("*.y*ml")} - {"kustomization.yaml"}
        assert on_disk == listed, f"{directory}: files {sorted(on_disk)}, listed {sorted(listed)}"
    assert {p for p in DEPLOY.iterdir() if p.is_dir()} == {ADAPTER}, "a folder here needs its own test"


def test_every_resource_is_named_once(resources, adapter_resources):
    names = [(r["kind"], r["metadata"]["name"]) for r in resources + adapter_resources]
    assert len(names) == len(set(names)), names


# --- the timings patch ----------------------------------------------------------------


def test_every_timing_is_in_the_patch_and_only_timings_are():
    (patch,) = load_documents(TIMINGS)
    assert (patch["kind"], patch["metadata"]["name"]) == ("Deployment", DEPLOYMENT)
    assert set(patch["spec"]) == {"template"} and set(patch["spec"]["template"]) == {"spec"}
    spec = patch["spec"]["template"]["spec"]
    assert set(spec) == {"terminationGracePeriodSeconds", "containers"}
    (base,) = load_documents(DEPLOY / "deployment.yaml")
    base_containers = {c["name"]: c for c in base["spec"]["template"]["spec"]["containers"]}
    assert "terminationGracePeriodSeconds" not in base["spec"]["template"]["spec"]
    for container in spec["containers"]:
        assert container["name"] in base_containers, (
            f"the patch names no container of deployment.yaml: {container['name']!r}"
        )
        assert set(container) <= {"name", "lifecycle", *PROBES}, container
        for probe in PROBES:
            assert set(container.get(probe, {})) <= PROBE_TIMINGS, f"{container['name']}.{probe}: not a timing"
    for container in base_containers.values():
        assert "lifecycle" not in container, f"{container['name']}: the preStop pause belongs in timings.yaml"
        for probe in PROBES:
            timings = set(container.get(probe, {})) & PROBE_TIMINGS
            assert not timings, f"{container['name']}.{probe}: {sorted(timings)} belong in timings.yaml"


def probe_timing(probe: dict, field: str) -> int:
    return probe.get(field, PROBE_DEFAULTS[field])


def test_every_probe_answers_within_its_period(containers):
    for container in containers.values():
        for name in PROBES:
            if name in container:
                probe = container[name]
                assert probe_timing(probe, "timeoutSeconds") < probe_timing(probe, "periodSeconds"), (
                    container["name"],
                    name,
                )


def test_the_startup_probe_outlasts_the_launchers_start_timeout(containers, serve):
    """A start that fails is reported by the launcher (with Triton's log) before the kubelet gives up."""
    probe = containers[TRITON]["startupProbe"]
    budget = probe_timing(probe, "initialDelaySeconds") + probe_timing(probe, "periodSeconds") * probe_timing(
        probe, "failureThreshold"
    )
    assert budget >= serve.startup_timeout, (
        f"startup probe gives up after {budget} s, the launcher after {serve.startup_timeout} s"
    )


def pre_stop_pause(container: dict) -> float:
    pre_stop = container["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"]["seconds"])
    program, seconds = pre_stop["exec"]["command"]
    assert program in ("sleep", "/bin/sleep"), pre_stop
    return float(seconds)


def test_the_grace_period_covers_the_pause_and_the_drain(pod, containers):
    pauses = {name: pre_stop_pause(container) for name, container in containers.items()}
    # Both keep serving until the pod is out of the Services, then stop together.
    assert len(set(pauses.values())) == 1 and pauses[TRITON] > 0, pauses
    needed = pauses[TRITON] + DRAIN_TIMEOUT_S + STOP_GRACE_S
    assert pod["terminationGracePeriodSeconds"] >= needed, (
        f"SIGKILL before the pause and the drain ({needed} s) are over"
    )


# --- the pod --------------------------------------------------------------------------


def test_the_deployment_selects_its_pods_and_leaves_the_count_to_the_hpa(deployment):
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert "replicas" not in deployment["spec"]


def test_the_server_runs_whisper_triton_serve_reachable_from_the_pod_network(serve):
    assert serve.command == "serve"
    assert serve.host == "0.0.0.0"  # the kubelet's probes and the Services reach the pod's IP


def dockerfile_server_stage() -> list[str]:
    lines, stage = [], None
    for line in DOCKERFILE.read_text().splitlines():
        match = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line.strip(), flags=re.IGNORECASE)
        if match:
            stage = match.group(1)
        elif stage == "server" and line.strip() and not line.lstrip().startswith("#"):
            lines.append(line.strip())
    return lines


def test_the_model_repository_is_the_one_the_image_holds(serve):
    """The server stage copies the checkout into the image; model_repository/ is part of it."""
    copies = [line.split()[2] for line in dockerfile_server_stage() if re.fullmatch(r"COPY\s+\.\s+\S+", line)]
    assert copies, "the server stage copies the checkout nowhere"
    repository = serve.model_repository
    assert repository.is_absolute()
    relative = repository.relative_to(Path(copies[0]))
    assert (REPO_ROOT / relative).is_dir(), f"{relative}: not in the checkout"
    ignored = {line.strip().strip("/") for line in DOCKERIGNORE.read_text().splitlines()}
    assert str(relative) not in ignored and relative.parts[0] not in ignored


def test_every_container_runs_the_compose_image(pod):
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    image = compose["services"]["triton"]["image"]
    for container in pod["containers"] + pod["initContainers"]:
        assert container["image"] == image, container["name"]


def container_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def test_the_container_ports_are_the_ones_the_server_listens_on(containers, serve, gateway_options):
    # The parser's defaults are the server's: each port is its flag, or the default.
    assert build_parser().parse_args(["serve"]).http_port == server.DEFAULT_HTTP_PORT
    assert container_ports(containers[TRITON]) == {
        "http": serve.http_port,
        "grpc": serve.grpc_port,
        "metrics": serve.metrics_port,
    }
    assert container_ports(containers[GATEWAY]) == {"gateway": gateway_options.port}


def test_the_gateway_reaches_this_pods_triton_over_grpc(gateway_options, serve):
    assert gateway_options.command == "gateway"
    host, _, port = gateway_options.triton_url.rpartition(":")
    assert host in ("localhost", "127.0.0.1") and int(port) == serve.grpc_port
    assert gateway_options.host == "0.0.0.0"


def triton_health_paths() -> dict[str, str]:
    """The paths Triton's own HTTP client asks for liveness and readiness (no server needed)."""
    import tritonclient.http

    asked: list[str] = []

    class Recorder:
        def get(self, uri, headers=None):
            asked.append(uri)
            return SimpleNamespace(status_code=200)

        def close(self):
            pass

    client = tritonclient.http.InferenceServerClient("localhost:1")
    client._client_stub.close()
    client._client_stub = Recorder()
    assert client.is_server_live() and client.is_server_ready()
    client.close()
    live, ready = asked
    return {"live": live, "ready": ready}


def gateway_get_paths() -> set[str]:
    from gateway.app import create_app

    return {route.path for route in create_app().routes if "GET" in getattr(route, "methods", ())}


def resolve_port(container: dict, port: int | str) -> int:
    ports = container_ports(container)
    if isinstance(port, str):
        assert port in ports, f"{container['name']}: no port named {port!r}"
        return ports[port]
    assert port in ports.values(), f"{container['name']}: no port {port}"
    return port


def test_every_probe_asks_what_the_server_serves(containers):
    health = triton_health_paths()
    assert health == {"live": "/v2/health/live", "ready": "/v2/health/ready"}  # as the README documents
    triton = containers[TRITON]
    expected = {"startupProbe": health["ready"], "livenessProbe": health["live"], "readinessProbe": health["ready"]}
    for name, path in expected.items():
        probe = triton[name]["httpGet"]
        assert probe["path"] == path, name
        assert resolve_port(triton, probe["port"]) == container_ports(triton)["http"], name
    gateway = containers[GATEWAY]
    readiness = gateway["readinessProbe"]["httpGet"]
    assert readiness["path"] == "/health" and readiness["path"] in gateway_get_paths()
    assert resolve_port(gateway, readiness["port"]) == container_ports(gateway)["gateway"]
    liveness = gateway["livenessProbe"]
    # /health is 503 while Triton starts: liveness must not ask it.
    assert "tcpSocket" in liveness or liveness["httpGet"]["path"] in gateway_get_paths() - {"/health"}
    resolve_port(gateway, (liveness.get("tcpSocket") or liveness.get("httpGet"))["port"])


def test_only_the_server_gets_a_gpu(containers, pod):
    assert int(containers[TRITON]["resources"]["limits"][GPU]) >= 1
    requests = containers[TRITON]["resources"].get("requests", {})
    assert GPU not in requests or requests[GPU] == containers[TRITON]["resources"]["limits"][GPU]
    for container in pod["initContainers"] + [containers[GATEWAY]]:
        assert GPU not in container.get("resources", {}).get("limits", {}), container["name"]


def mounts(container: dict) -> dict[str, dict]:
    """Mount path -> the volume mount."""
    return {m["mountPath"]: m for m in container.get("volumeMounts", [])}


def env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_the_checkpoint_and_caches_live_on_volumes(pod, containers):
    volumes = {v["name"]: v for v in pod["volumes"]}
    used = {m["name"] for c in pod["containers"] + pod["initContainers"] for m in c.get("volumeMounts", [])}
    assert used == set(volumes), f"volumes {sorted(volumes)}, mounted {sorted(used)}"
    triton = containers[TRITON]
    variables = env(triton)
    assert variables[CHECKPOINT_ENV], CHECKPOINT_ENV
    for variable in (CACHE_ENV, FLASHINFER_ENV):
        mount = mounts(triton).get(variables[variable])
        assert mount is not None, f"{variable}={variables[variable]} is not a mounted volume"
        assert not mount.get("readOnly", False), f"{variable}: written to, so not read-only"


def test_the_flashinfer_kernels_come_from_a_read_only_source(pod, containers):
    (init,) = [c for c in pod["initContainers"] if c["name"] == FLASHINFER_INIT]
    workspace = mounts(containers[TRITON])[env(containers[TRITON])[FLASHINFER_ENV]]
    init_mounts = {m["name"]: m for m in init["volumeMounts"]}
    target = init_mounts[workspace["name"]]
    assert not target.get("readOnly", False)
    (source,) = [m for m in init["volumeMounts"] if m is not target]
    assert source["readOnly"] is True
    # The source is mounted nowhere writable.
    for container in pod["containers"] + pod["initContainers"]:
        for mount in container.get("volumeMounts", []):
            assert mount["name"] != source["name"] or mount.get("readOnly"), container["name"]
    script = " ".join(init["command"])
    assert re.search(
        rf"cp -a {re.escape(source['mountPath'])}/\. {re.escape(target['mountPath'])}/?(\s|$|\")", script
    ), script


def quantity(text: str | int) -> float:
    """A Kubernetes quantity: 2Gi, 500M, 800m, 16."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(m|k|M|G|T|Ki|Mi|Gi|Ti)?", str(text))
    assert match, f"not a Kubernetes quantity: {text!r}"
    number, unit = float(match.group(1)), match.group(2) or ""
    if unit.endswith("i"):
        return number * 1024 ** ("KMGT".index(unit[0]) + 1)
    return number * {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[unit]


def compose_size(text: str) -> float:
    """A Compose byte size (2gb, 512m) in bytes."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([bkmg]?)b?", str(text).lower())
    assert match, f"not a Compose size: {text!r}"
    return float(match.group(1)) * 1024 ** "bkmg".index(match.group(2) or "b")


def test_shared_memory_is_as_large_as_compose_gives(pod, containers):
    """The Python backend passes tensors through /dev/shm, 64 MiB by default in a pod."""
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    volumes = {v["name"]: v for v in pod["volumes"]}
    shm = volumes[mounts(containers[TRITON])["/dev/shm"]["name"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    assert quantity(shm["sizeLimit"]) >= compose_size(compose["services"]["triton"]["shm_size"])


# --- Services, disruption budget, monitoring ----------------------------------------------


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def test_every_service_reaches_a_port_the_pod_listens_on(resources, deployment, containers):
    all_ports = {port: name for c in containers.values() for name, port in container_ports(c).items()}
    reached = set()
    for service in (r for r in resources if r["kind"] == "Service"):
        name = service["metadata"]["name"]
        assert service["spec"]["selector"].items() <= pod_labels(deployment).items(), name
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            owners = [
                c for c in containers.values() if target in container_ports(c) or target in container_ports(c).values()
            ]
            assert owners, f"{name}: no container port {target!r}"
            number = resolve_port(owners[0], target)
            assert port["port"] == number, f"{name}: port {port['port']} in front of {number}; keep them alike"
            reached.add(number)
    # HTTP, gRPC, metrics and the gateway each have a Service.
    assert reached == set(all_ports), f"no Service for {sorted(set(all_ports) - reached)}"


def test_the_disruption_budget_covers_the_pods_and_leaves_one_serving(resources, deployment):
    budget = one(resources, "PodDisruptionBudget")["spec"]
    assert budget["selector"]["matchLabels"].items() <= pod_labels(deployment).items()
    hpa = one(resources, "HorizontalPodAutoscaler")["spec"]
    assert "maxUnavailable" in budget and budget["maxUnavailable"] < hpa["minReplicas"]


SERVICE_MONITOR_ENDPOINT_FIELDS = {
    "port",
    "path",
    "interval",
    "scrapeTimeout",
    "scheme",
    "honorLabels",
    "relabelings",
    "metricRelabelings",
}


def test_the_service_monitor_scrapes_the_metrics_port(resources, containers, serve):
    monitor = one(resources, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["name"]
    assert set(monitor["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}, monitor["spec"]
    selector = monitor["spec"]["selector"]["matchLabels"]  # required by the CRD
    services = [
        r for r in resources if r["kind"] == "Service" and selector.items() <= r["metadata"].get("labels", {}).items()
    ]
    assert len(services) == 1, f"the ServiceMonitor selects {[s['metadata']['name'] for s in services]}"
    ports = {p["name"]: p for p in services[0]["spec"]["ports"]}
    metrics_path = urllib.parse.urlparse(TritonServer(ServerSettings(model_repository=Path("."))).metrics_url).path
    assert monitor["spec"]["endpoints"]
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= SERVICE_MONITOR_ENDPOINT_FIELDS, sorted(set(endpoint) - SERVICE_MONITOR_ENDPOINT_FIELDS)
        assert endpoint["port"] in ports, f"the metrics Service has no port named {endpoint['port']!r}"
        assert resolve_port(containers[TRITON], ports[endpoint["port"]]["targetPort"]) == serve.metrics_port
        assert endpoint["path"] == metrics_path
        assert re.fullmatch(r"(\d+(ms|s|m|h))+", endpoint["interval"]), endpoint["interval"]


# --- autoscaling ----------------------------------------------------------------------


def whisper_metric_families() -> dict[str, str]:
    """Name -> counter, gauge or histogram, as python_backend_lib/serving/metrics.py creates them."""
    families = {}
    source = Path(importlib.util.find_spec(METRICS_MODULE).origin).read_text()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("counter", "gauge", "histogram")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            families[node.args[0].value] = node.func.attr
    assert "whisper_waiting_windows" in families, "metrics.py was not parsed as expected"
    return families


def whisper_series() -> set[str]:
    """The series names Prometheus stores for those families."""
    series = set()
    for name, kind in whisper_metric_families().items():
        series |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
    return series


@pytest.fixture(scope="module")
def adapter_rules(adapter_resources) -> list[dict]:
    config_map = one(adapter_resources, "ConfigMap")
    return yaml.safe_load(config_map["data"]["config.yaml"])["rules"]


def series_of(rule: dict) -> str:
    match = re.fullmatch(r"([A-Za-z_:][\w:]*)\{(.*)\}", rule["seriesQuery"])
    assert match, f"a seriesQuery names one metric: {rule['seriesQuery']}"
    return match.group(1)


def exposed_name(rule: dict) -> str:
    """The custom metric's name, as the adapter derives it (`as` may use the regex's groups)."""
    series = series_of(rule)
    match = re.search(rule["name"]["matches"], series)
    assert match, f"name.matches {rule['name']['matches']!r} does not match {series!r}: the rule exposes nothing"
    replacement = rule["name"].get("as") or "$1"
    return match.expand(re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", replacement))


def test_every_adapter_rule_reads_the_whisper_models_metrics(adapter_rules):
    known = whisper_series()
    for rule in adapter_rules:
        series = series_of(rule)
        assert series in known, f"{series}: not a metric {METRICS_MODULE} publishes"
        query = rule["metricsQuery"]
        named = set(re.findall(r"\bwhisper_\w+", query)) | {series}
        assert named <= known, f"not published by metrics.py: {sorted(named - known)}"
        assert "<<.LabelMatchers>>" in query and "<<.GroupBy>>" in query, query
        for opening, closing in ("()", "{}", "[]"):
            assert query.count(opening) == query.count(closing), query
        overrides = rule["resources"]["overrides"]
        assert overrides["namespace"]["resource"] == "namespace"
        assert overrides["pod"]["resource"] in ("pod", "pods")
        assert 'namespace!=""' in rule["seriesQuery"] and 'pod!=""' in rule["seriesQuery"]
        exposed_name(rule)


def test_the_hpa_scales_the_deployment_on_the_engines_queue(resources, adapter_rules):
    hpa = one(resources, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", DEPLOYMENT)
    served = {exposed_name(rule): rule for rule in adapter_rules}
    reads_queue = False
    for metric in hpa["spec"]["metrics"]:
        assert metric["type"] == "Pods", metric
        name = metric["pods"]["metric"]["name"]
        assert name in served, f"{name}: prometheus-adapter serves only {sorted(served)}"
        assert metric["pods"]["target"]["type"] == "AverageValue"
        assert quantity(metric["pods"]["target"]["averageValue"]) > 0
        rule = served[name]
        reads_queue |= bool(
            QUEUE_METRICS & ({series_of(rule)} | set(re.findall(r"\bwhisper_\w+", rule["metricsQuery"])))
        )
    assert reads_queue, "no HPA metric reads the engine's queue"
    assert QUEUE_METRICS <= set(whisper_metric_families())
    assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


# --- the documentation -------------------------------------------------------------------


def test_the_documentation_names_what_the_manifests_use(resources, adapter_rules):
    doc = DOC.read_text(encoding="utf-8")
    assert "kubectl apply -k deploy/kubernetes" in doc
    for path in sorted(DEPLOY.rglob("*.yaml")):
        assert str(path.relative_to(DEPLOY)) in doc, f"docs/kubernetes.md does not mention {path.relative_to(DEPLOY)}"
    hpa = one(resources, "HorizontalPodAutoscaler")
    for metric in hpa["spec"]["metrics"]:
        name, target = metric["pods"]["metric"]["name"], str(metric["pods"]["target"]["averageValue"])
        lines = [
            line for line in doc.splitlines() if name in line and f"averageValue: {target}" in line.replace('"', "")
        ]
        assert lines, f"docs/kubernetes.md gives no line with {name} and its target averageValue: {target}"
    for rule in adapter_rules:
        assert series_of(rule) in doc, series_of(rule)


def test_the_gateway_takes_its_api_key_from_an_optional_secret(containers):
    """The key reaches the gateway under the name it reads, from a Secret the pod
    starts without (no key asked for then), and /health, the probes' path, stays open."""
    from gateway.api_key import API_KEY_ENV, PROTECTED_PREFIX

    (variable,) = [v for v in containers[GATEWAY].get("env", []) if v["name"] == API_KEY_ENV]
    secret = variable["valueFrom"]["secretKeyRef"]
    assert secret["optional"] is True and secret["name"] and secret["key"]
    assert not containers[GATEWAY]["readinessProbe"]["httpGet"]["path"].startswith(PROTECTED_PREFIX)
