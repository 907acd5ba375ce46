"""docker-compose.yml and docker/Dockerfile, checked without a Docker engine.

The compose file is validated against the Compose Specification's JSON schema
(the copy that the check-jsonschema package vendors, so its version is pinned
with the test dependencies), then against what the stack must do: the GPU and
CPU servers (the GPU one on the image with the GPU engine, which it requires),
their health checks, and locust pointed at whichever runs. The Dockerfile's
install commands must be those the README's "Docker" section documents.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.resources
import json
import re
import shlex
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from python_backend_lib.apps.server import STOP_GRACE_S
from python_backend_lib.apps.server_watch import DRAIN_TIMEOUT_S

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
README = REPO_ROOT / "README.md"

TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"
# tritonserver, through the launcher that drains requests in flight on SIGTERM.
TRITON_COMMAND = ["whisper-triton", "serve", "--host=0.0.0.0", "--model-repository=/models"]
# On the GPUs, it refuses to start without FlashInfer and CUDA graphs rather than serve the slow path.
GPU_TRITON_COMMAND = [*TRITON_COMMAND, "--require-gpu-engine"]
# The Dockerfile's stages: the CPU image, and the GPU one built on it with the `gpu` extra.
SERVER_STAGE, GPU_SERVER_STAGE = "server", "server-gpu"
HEALTH_PATH = "/v2/health/ready"
# Triton's ports inside the container.
HTTP_PORT, GRPC_PORT, METRICS_PORT = 8000, 8001, 8002
GPU_SERVICE, CPU_SERVICE = "triton", "triton-cpu"
GATEWAY = "gateway"
GATEWAY_PORT = 9000
# What each service's healthcheck must ask.
HEALTH_URLS = {
    GPU_SERVICE: f"http://localhost:{HTTP_PORT}{HEALTH_PATH}",
    CPU_SERVICE: f"http://localhost:{HTTP_PORT}{HEALTH_PATH}",
    GATEWAY: f"http://localhost:{GATEWAY_PORT}/health",
}
LOCUST_MASTER, LOCUST_WORKER = "locust-master", "locust-worker"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())  # safe_load resolves the `<<:` merge keys


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def compose_schema() -> dict:
    vendored = importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    return json.loads(vendored.read_text(encoding="utf-8"))


def test_the_compose_file_follows_the_compose_specification(compose):
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(compose)]
    assert not errors, "\n".join(errors)


def test_the_schema_catches_a_mistake(compose):
    """The check above is not vacuous: a misspelt key fails it."""
    schema = compose_schema()
    broken = {**compose, "services": {**compose["services"], GPU_SERVICE: {**compose["services"][GPU_SERVICE]}}}
    broken["services"][GPU_SERVICE]["healthchek"] = broken["services"][GPU_SERVICE].pop("healthcheck")
    assert not jsonschema.validators.validator_for(schema)(schema).is_valid(broken)


def test_the_servers_are_one_gpu_and_one_cpu_profile(services):
    assert services[GPU_SERVICE]["profiles"] == ["gpu"]
    assert services[CPU_SERVICE]["profiles"] == ["cpu"]
    servers = [name for name, s in services.items() if s.get("command") in (TRITON_COMMAND, GPU_TRITON_COMMAND)]
    assert sorted(servers) == sorted([GPU_SERVICE, CPU_SERVICE])


@pytest.mark.parametrize("command", [TRITON_COMMAND, GPU_TRITON_COMMAND], ids=["cpu", "gpu"])
def test_the_server_command_parses_and_listens_beyond_its_container(command):
    from whisper_triton.cli import build_parser

    program, *arguments = command
    assert program == "whisper-triton"
    options = build_parser().parse_args(arguments)  # the real command line accepts every flag
    assert options.host == "0.0.0.0"  # Triton's default, 127.0.0.1, is unreachable from other containers
    assert options.require_gpu_engine == (command == GPU_TRITON_COMMAND)


def test_the_gpu_server_runs_the_gpu_image_and_requires_the_gpu_engine(services):
    gpu, cpu = services[GPU_SERVICE], services[CPU_SERVICE]
    assert gpu["build"]["target"] == GPU_SERVER_STAGE and cpu["build"]["target"] == SERVER_STAGE
    assert gpu["command"] == GPU_TRITON_COMMAND and cpu["command"] == TRITON_COMMAND
    assert gpu["image"] != cpu["image"]  # two images: the CPU one stays without FlashInfer
    # FlashInfer's kernels are compiled once, into a volume, not at every start.
    workspace = gpu["environment"]["FLASHINFER_WORKSPACE_BASE"]
    assert any(v.split(":")[1] == workspace for v in gpu["volumes"] if not v.startswith((".", "$")))


def test_the_gpu_server_reserves_nvidia_gpus(services):
    devices = services[GPU_SERVICE]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)


def test_the_cpu_server_reserves_no_gpu_and_hides_any(services):
    cpu = services[CPU_SERVICE]
    assert "deploy" not in cpu and "gpus" not in cpu
    assert cpu["environment"]["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.parametrize("name", [GPU_SERVICE, CPU_SERVICE])
def test_each_server_runs_the_model_repository_with_a_checkpoint(services, name):
    service = services[name]
    assert service["build"]["target"] in (SERVER_STAGE, GPU_SERVER_STAGE)
    assert service["command"][: len(TRITON_COMMAND)] == TRITON_COMMAND
    # Docker's SIGKILL must not come before the drain (30 s) and Triton's own stop are over.
    assert int(service["stop_grace_period"].removesuffix("s")) > DRAIN_TIMEOUT_S + STOP_GRACE_S
    assert any(v.split(":")[:2] == ["./model_repository", "/models"] for v in service["volumes"])
    assert (REPO_ROOT / "model_repository").is_dir()
    assert service["environment"]["WHISPER_TRITON_CHECKPOINT"]
    published = {int(p.split(":")[-1]) for p in service["ports"]}
    assert {HTTP_PORT, GRPC_PORT, METRICS_PORT} <= published


def health_command(service: dict) -> list[str]:
    """The healthcheck's command as argv: CMD lists as they are, CMD-SHELL split like a shell."""
    test = service["healthcheck"]["test"]
    if isinstance(test, str):
        return shlex.split(test)
    kind, *argv = test
    assert kind in ("CMD", "CMD-SHELL"), f"a healthcheck test starts with CMD or CMD-SHELL, not {kind!r}"
    return argv if kind == "CMD" else shlex.split(" ".join(argv))


def test_every_healthcheck_asks_whether_its_service_is_ready(services):
    checked = {name: s for name, s in services.items() if "healthcheck" in s}
    assert set(checked) == set(HEALTH_URLS)
    for name, service in checked.items():
        argv = health_command(service)
        assert argv, f"{name}: empty healthcheck"
        url = HEALTH_URLS[name]
        if argv[:2] == ["python3", "-c"]:
            code = argv[2]
            compile(code, f"{name} healthcheck", "exec")  # a SyntaxError fails the test
            assert url in code, code
        else:
            assert argv[0] in ("curl", "wget"), f"{name}: unexpected healthcheck program {argv[0]!r}"
            assert url in argv, argv
        for duration in ("interval", "timeout", "start_period"):
            assert re.fullmatch(r"\d+(ms|s|m|h)", service["healthcheck"][duration]), duration


def names_on_the_network(service_name: str, service: dict) -> set[str]:
    """The host names under which other services reach this one."""
    aliases = set()
    networks = service.get("networks") or {}
    if isinstance(networks, dict):
        for network in networks.values():
            aliases.update((network or {}).get("aliases", []))
    return {service_name, *aliases}


@pytest.mark.parametrize("locust", [LOCUST_MASTER, LOCUST_WORKER])
def test_locust_points_at_whichever_server_runs(services, locust):
    service = services[locust]
    assert service["build"]["target"] == "loadtest"
    assert service["profiles"] == ["loadtest"]
    environment = service["environment"]
    for variable, port in (("LOCUST_TRITON_HTTP", HTTP_PORT), ("LOCUST_TRITON_GRPC", GRPC_PORT)):
        host, _, target_port = environment[variable].rpartition(":")
        assert int(target_port) == port, variable
        for server in (GPU_SERVICE, CPU_SERVICE):
            assert host in names_on_the_network(server, services[server]), f"{variable}: {server} is not {host!r}"
    for server in (GPU_SERVICE, CPU_SERVICE):
        dependency = service["depends_on"][server]
        assert dependency["condition"] == "service_healthy"
        assert dependency["required"] is False  # only one server profile runs at a time


def test_the_gateway_runs_beside_either_server_and_reaches_it_over_grpc(services):
    from whisper_triton.cli import build_parser

    gateway = services[GATEWAY]
    assert sorted(gateway["profiles"]) == ["cpu", "gpu"]
    assert gateway["build"]["target"] == "server"  # the image that installs whisper-triton
    program, *arguments = gateway["command"]
    assert program == "whisper-triton" and arguments[0] == "gateway"
    options = build_parser().parse_args(arguments)  # the real command line accepts every flag
    host, _, port = options.triton_url.rpartition(":")
    assert int(port) == GRPC_PORT
    for server in (GPU_SERVICE, CPU_SERVICE):
        assert host in names_on_the_network(server, services[server]), f"{server} is not {host!r}"
        dependency = gateway["depends_on"][server]
        assert dependency["condition"] == "service_healthy" and dependency["required"] is False
    assert options.host == "0.0.0.0"  # reachable from outside its container
    assert f"{options.port}:{options.port}" in gateway["ports"] and options.port == GATEWAY_PORT


def test_the_locust_pair_is_a_master_and_its_worker(services):
    assert "--master" in services[LOCUST_MASTER]["command"]
    worker = services[LOCUST_WORKER]["command"]
    assert "--worker" in worker and f"--master-host={LOCUST_MASTER}" in worker


def test_the_locust_options_exist_in_the_locustfile():
    locustfile = (REPO_ROOT / "loadtest" / "locustfile.py").read_text()
    for variable in ("LOCUST_TRITON_HTTP", "LOCUST_TRITON_GRPC"):
        assert f'env_var="{variable}"' in locustfile


# --- the Dockerfile ----------------------------------------------------------------


def dockerfile_stages(text: str) -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions as (KEYWORD, arguments), continuations joined, comments dropped."""
    logical, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for instruction in logical:
        keyword, _, arguments = instruction.partition(" ")
        if keyword.upper() == "FROM":
            match = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", arguments.strip(), flags=re.IGNORECASE)
            assert match, f"every stage is named: FROM {arguments}"
            current = stages.setdefault(match.group(2), [])
            current.append(("FROM", match.group(1)))
        else:
            current.append((keyword.upper(), " ".join(arguments.split())))
    return stages


def pip_commands(commands: list[str]) -> list[str]:
    return [" ".join(c.split()) for c in commands if "pip install" in c]


def readme_docker_commands() -> list[str]:
    """The shell lines in the fenced code blocks of README.md's "Docker" section."""
    assert README.is_file(), "README.md is missing; its Docker section documents the image's install commands"
    text = README.read_text(encoding="utf-8")
    heading = re.search(r"^(#+)\s+Docker\b.*$", text, flags=re.MULTILINE)
    assert heading, 'README.md has no "Docker" section documenting the image\'s install commands'
    level = len(heading.group(1))
    rest = text[heading.end() :]
    following = re.search(rf"^#{{1,{level}}}\s", rest, flags=re.MULTILINE)
    section = rest[: following.start()] if following else rest
    lines = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL):
        lines += [line.strip().removeprefix("$ ") for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


@pytest.fixture(scope="module")
def stages() -> dict[str, list[tuple[str, str]]]:
    return dockerfile_stages(DOCKERFILE.read_text())


def test_the_compose_build_targets_are_dockerfile_stages(services, stages):
    for name, service in services.items():
        build = service["build"]
        assert (REPO_ROOT / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE, name
        assert build["target"] in stages, f"{name}: no stage {build['target']!r} in {DOCKERFILE}"


def test_the_server_stage_is_the_official_triton_image(stages):
    assert stages[SERVER_STAGE][0] == ("FROM", TRITON_IMAGE)
    (command,) = [json.loads(arguments) for keyword, arguments in stages[SERVER_STAGE] if keyword == "CMD"]
    assert command == TRITON_COMMAND  # as docker-compose.yml runs it


def stage_pip_commands(stage: list[tuple[str, str]]) -> list[str]:
    runs = [arguments for keyword, arguments in stage if keyword == "RUN"]
    return pip_commands([part.strip() for run in runs for part in run.split("&&")])


def test_the_servers_install_exactly_what_the_readme_documents(stages):
    dockerfile = stage_pip_commands(stages[SERVER_STAGE]) + stage_pip_commands(stages[GPU_SERVER_STAGE])
    readme = pip_commands(readme_docker_commands())
    assert stage_pip_commands(stages[SERVER_STAGE]), "the server stage installs nothing with pip"
    assert dockerfile == readme, f"Dockerfile: {dockerfile}\nREADME:     {readme}"


def installs_the_gpu_extra(command: str) -> bool:
    """Whether a pip command installs this project with its `gpu` extra."""
    return any(re.fullmatch(r"\.\[(.*,)?gpu(,.*)?\]", word.strip("'\"")) for word in shlex.split(command))


def test_the_gpu_image_is_the_server_with_the_gpu_extra_and_the_cpu_image_stays_without(stages):
    assert stages[GPU_SERVER_STAGE][0] == ("FROM", SERVER_STAGE)  # the same server, plus FlashInfer
    assert any(installs_the_gpu_extra(c) for c in stage_pip_commands(stages[GPU_SERVER_STAGE]))
    assert not any(installs_the_gpu_extra(c) or "flashinfer" in c for c in stage_pip_commands(stages[SERVER_STAGE]))
    gpu_extra = [r for r in importlib.metadata.requires("whisper-triton") if re.search(r"extra\s*==\s*.gpu.", r)]
    assert any(requirement.startswith("flashinfer-python") for requirement in gpu_extra), gpu_extra


def test_every_copied_path_exists(stages):
    for stage in stages.values():
        for keyword, arguments in stage:
            if keyword == "COPY" and not arguments.startswith("--from"):
                *sources, _destination = arguments.split()
                for source in sources:
                    assert (REPO_ROOT / source).exists(), f"COPY {source}: not in the repository"


# --- the locust image ----------------------------------------------------------------

LOADTEST_STAGE = "loadtest"
LOCUSTFILE = REPO_ROOT / "loadtest" / "locustfile.py"
FIRST_PARTY = ("python_backend_lib", "clients", "gateway", "whisper_triton", "loadtest", "bench")


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside functions (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for statement in block.body
        for node in ast.walk(statement)
    }
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}  # submodules imported by name
    return names


def module_file(name: str) -> Path | None:
    """The repository file that defines first-party module `name`, or None (not a module: a name in one)."""
    base = REPO_ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def first_party_closure(start: Path) -> tuple[set[Path], set[str]]:
    """The repository files that importing `start` reads (each module's packages too),
    and the third-party top-level modules they import."""
    files, foreign, todo = set(), set(), [start]
    while todo:
        path = todo.pop()
        if path in files:
            continue
        files.add(path)
        for name in imported_modules(path):
            top = name.split(".")[0]
            if top not in FIRST_PARTY:
                if top not in sys.stdlib_module_names and top != "__future__":
                    foreign.add(top)
                continue
            parts = name.split(".")
            for depth in range(1, len(parts) + 1):  # a module's packages run their __init__ first
                found = module_file(".".join(parts[:depth]))
                if found is not None:
                    todo.append(found)
    return files, foreign


def requirement_closure(requirements: list[str]) -> set[str]:
    """The distributions that pip installs for `requirements` (with their extras), by
    this environment's metadata, as canonical names."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    done: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in done:
            continue
        done.add(name)
        for text in importlib.metadata.requires(requirement.name) or []:
            needed = Requirement(text)
            extras = requirement.extras or {""}
            if needed.marker is None or any(needed.marker.evaluate({"extra": extra}) for extra in extras):
                todo.append(needed)
    return done


def stage_copied_files(stage: list[tuple[str, str]]) -> set[Path]:
    copied = set()
    for keyword, arguments in stage:
        if keyword == "COPY" and not arguments.startswith("--from"):
            for source in arguments.split()[:-1]:
                path = REPO_ROOT / source
                copied |= set(path.rglob("*.py")) if path.is_dir() else {path}
    return copied


def stage_requirements(stage: list[tuple[str, str]]) -> list[str]:
    requirements = []
    for command in stage_pip_commands(stage):
        words = shlex.split(command)
        requirements += [w for w in words[words.index("install") + 1 :] if not w.startswith("-")]
    return requirements


def test_the_locust_image_holds_what_its_locustfile_imports(stages):
    """The image copies a few files of the repository and installs a few packages: every
    module the locustfile imports, directly or through them, must be among them, or
    `docker compose --profile loadtest` starts a locust that fails on its first import."""
    from packaging.utils import canonicalize_name

    stage = stages[LOADTEST_STAGE]
    (entrypoint,) = [json.loads(arguments) for keyword, arguments in stage if keyword == "ENTRYPOINT"]
    assert entrypoint[-1] == "/src/" + LOCUSTFILE.relative_to(REPO_ROOT).as_posix()
    needed, foreign = first_party_closure(LOCUSTFILE)
    missing = sorted(p.relative_to(REPO_ROOT).as_posix() for p in needed - stage_copied_files(stage))
    assert not missing, f"the loadtest stage does not COPY {missing}"
    installed = requirement_closure(stage_requirements(stage))
    providers = importlib.metadata.packages_distributions()
    unprovided = sorted(
        top for top in foreign if not {canonicalize_name(d) for d in providers.get(top, [])} & installed
    )
    assert not unprovided, f"the loadtest stage installs nothing that provides {unprovided}"


def test_a_locustfile_import_the_image_lacks_is_found(tmp_path):
    """The closure follows imports through the repository's packages: the gateway's app,
    imported for one constant, brings FastAPI and the library's audio with it."""
    needed, foreign = first_party_closure(REPO_ROOT / "gateway" / "app.py")
    assert REPO_ROOT / "gateway" / "__init__.py" in needed and "fastapi" in foreign
    assert "gevent" in requirement_closure(["locust==2.47.0"])
    assert "grpcio" in requirement_closure(["tritonclient[grpc]==2.73.0"])
