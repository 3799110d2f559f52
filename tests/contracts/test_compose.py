"""compose.yaml and the Dockerfile against the code: every regen command, option and
environment variable the deployment uses exists, and it keeps regen's guarantees."""

from __future__ import annotations

import json
import re
import shlex
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from regen.cli import main
from regen.common import defaults

REPO = Path(__file__).resolve().parents[2]
COMPOSE: dict[str, Any] = yaml.safe_load((REPO / "compose.yaml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
DOCKERFILE = (REPO / "Dockerfile").read_text()
# The source folders the image copies; only `regen` is installed (the others are its
# subpackages, linked from regen/: see docs/design/README.md, "Layout").
PACKAGES = ("regen", "common", "consumers", "producer")


def as_argv(value: str | list[str]) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def image_entrypoint() -> list[str]:
    (line,) = re.findall(r"^ENTRYPOINT (.+)$", DOCKERFILE, re.MULTILINE)
    entrypoint: list[str] = json.loads(line)
    return entrypoint


def regen_services() -> dict[str, list[str]]:
    """Services built from the regen image, with the argv each container runs."""
    return {
        name: as_argv(service.get("entrypoint", image_entrypoint()))
        + as_argv(service.get("command", []))
        for name, service in SERVICES.items()
        if "build" in service
    }


def cli_problems(args: list[str]) -> list[str]:
    """What in `regen ARGS` the click CLI would refuse (compose values like ${VAR} pass)."""
    command: click.Command = main
    path = ["regen"]
    args = list(args)
    while isinstance(command, click.Group):
        if not args or args[0].startswith("-"):
            return [f"{' '.join(path)} needs a subcommand"]
        name = args.pop(0)
        if name not in command.commands:
            return [f"{' '.join(path)} has no command {name!r}"]
        command = command.commands[name]
        path.append(name)
    where = " ".join(path)
    options = {
        opt: param
        for param in command.params
        if isinstance(param, click.Option)
        for opt in (*param.opts, *param.secondary_opts)
    }
    problems: list[str] = []
    given: set[str | None] = set()
    positional: list[str] = []
    while args:
        arg = args.pop(0)
        if not arg.startswith("-"):
            positional.append(arg)
            continue
        name, eq, inline = arg.partition("=")
        option = options.get(name)
        if option is None:
            problems.append(f"{where} has no option {name}")
            continue
        given.add(option.name)
        if option.is_flag or option.count:
            if eq:
                problems.append(f"{where} {name} is a flag: it takes no value")
            continue
        value = inline if eq else (args.pop(0) if args and not args[0].startswith("-") else None)
        if value is None:
            problems.append(f"{where} {name} needs a value")
        elif "$" not in value and not isinstance(option.type, click.Path):
            try:
                option.type.convert(value, option, None)
            except click.BadParameter as exc:
                problems.append(f"{where} {name} {value}: {exc.message}")
    arguments = [p for p in command.params if isinstance(p, click.Argument)]
    if positional and not arguments:
        problems.append(f"{where} takes no arguments, got {positional}")
    for param in command.params:
        if not param.required:
            continue
        if isinstance(param, click.Option) and param.name not in given:
            problems.append(f"{where} needs {param.opts[0]}")
        if isinstance(param, click.Argument) and not positional:
            problems.append(f"{where} needs {param.human_readable_name}")
    return problems


def options_of(argv: list[str]) -> dict[str, str]:
    """`--name value` pairs of an argv (flags map to "")."""
    pairs: dict[str, str] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            following = argv[i + 1] if i + 1 < len(argv) else ""
            pairs[arg] = "" if following.startswith("--") else following
    return pairs


@pytest.mark.parametrize("service", sorted(regen_services()))
def test_every_regen_service_runs_a_command_and_options_the_cli_has(service: str) -> None:
    argv = regen_services()[service]
    assert argv[0] == "regen", argv
    assert cli_problems(argv[1:]) == []


@pytest.mark.parametrize(
    "args",
    [
        ["worker", "generat"],
        ["worker"],
        ["worker", "generate", "--bogus", "1"],
        ["worker", "tokenize", "--out"],
        ["worker", "generate", "--trust-remote-code=yes"],
        ["worker", "tokenize", "--on-truncated", "sometimes"],
        ["worker", "generate", "--max-inflight", "0"],
        ["worker", "tokenize", "stray"],
        ["enqueue", "/data/x.jsonl", "--job", "j"],
        ["enqueue", "--job", "j", "--model", "m"],
    ],
)
def test_the_check_refuses_what_the_cli_would_refuse(args: list[str]) -> None:
    assert cli_problems(args)


def test_compose_runs_the_whole_pipeline() -> None:
    assert {"redis", "sglang", "generate", "tokenize", "flower", "producer"} <= set(SERVICES)
    argv = regen_services()
    assert argv["generate"][1:3] == ["worker", "generate"]
    assert argv["tokenize"][1:3] == ["worker", "tokenize"]
    assert argv["producer"][1] == "enqueue"
    assert SERVICES["producer"]["profiles"] == ["enqueue"]
    assert SERVICES["producer"]["restart"] == "no"
    # The tokenize worker's shards outlive its container: its --out (unless SHARDS_OUT
    # names a bucket) and its spool for a bucket's open shards are on the shards volume.
    out = options_of(argv["tokenize"])["--out"]
    default = re.fullmatch(r"\$\{SHARDS_OUT:-(/[^}]*)\}", out)
    assert default, out
    default_out = default.group(1)
    tokenize_env = SERVICES["tokenize"]["environment"]
    for folder in (default_out, tokenize_env["REGEN_SPOOL_DIR"]):
        assert any(
            folder.startswith(volume.split(":")[1]) and volume.startswith("shards:")
            for volume in SERVICES["tokenize"]["volumes"]
        ), folder
    # Bucket credentials are passed through from the host, never written here.
    aws = {name: value for name, value in tokenize_env.items() if name.startswith("AWS_")}
    assert aws and set(aws.values()) == {None}
    assert "shards" in COMPOSE["volumes"]


def test_the_image_runs_the_installed_regen_command() -> None:
    assert image_entrypoint() == ["regen"]
    (script,) = entry_points(group="console_scripts", name="regen")
    assert script.value == "regen.cli:main"
    # pyproject.toml's package-dir: the folders the wheel is built from, all in the one
    # `regen` namespace (no tomllib: Python 3.10 is supported).
    pyproject = (REPO / "pyproject.toml").read_text()
    (table,) = re.findall(r"^\[tool\.setuptools\.package-dir\]\n((?:.+\n)+)", pyproject, re.M)
    mapped = dict(re.findall(r'^"?([\w.]+)"? = "(\w+)"$', table, re.M))
    assert sorted(mapped.values()) == sorted(PACKAGES)
    assert {name.split(".")[0] for name in mapped} == {"regen"}
    for package in PACKAGES:  # a package missing from the image fails only at run time
        assert f"COPY {package} {package}" in DOCKERFILE
    assert re.search(r"^FROM python:3\.11-slim$", DOCKERFILE, re.MULTILINE)
    assert "pip install --no-deps ." in DOCKERFILE  # no extras: SGLang is reached over HTTP


def test_redis_persists_every_write_refuses_eviction_and_needs_a_password() -> None:
    options = options_of(as_argv(SERVICES["redis"]["command"]))
    assert options["--appendonly"] == "yes"
    assert options["--appendfsync"] == "always"
    assert options["--maxmemory-policy"] == "noeviction"
    assert options["--requirepass"].startswith("${REDIS_PASSWORD")
    assert "healthcheck" in SERVICES["redis"]


def test_every_broker_client_uses_the_password_and_one_visibility_timeout() -> None:
    clients = {name: SERVICES[name]["environment"] for name in regen_services()}
    clients["flower"] = SERVICES["flower"]["environment"]
    for name, env in clients.items():
        url = env.get("REGEN_REDIS_URL") or env["CELERY_BROKER_URL"]
        # The compose Redis unless .env points regen at the `ha` profile's sentinels.
        assert url.startswith("${REGEN_REDIS_URL:-redis://:${REDIS_PASSWORD"), name
        assert "@redis:6379/" in url, name
        # The chunk lease: kombu restores a message not renewed for longer, wherever its
        # sweep runs, so every process must agree.
        timeout = env["REGEN_VISIBILITY_TIMEOUT"]
        assert timeout == f"${{REGEN_VISIBILITY_TIMEOUT:-{defaults.VISIBILITY_TIMEOUT_S}}}", name
    flower_config = COMPOSE["configs"]["flower-celeryconfig"]["content"]
    assert 'os.environ["REGEN_VISIBILITY_TIMEOUT"]' in flower_config
    assert "broker_transport_options" in flower_config


def test_the_generate_worker_waits_for_a_healthy_sglang_server() -> None:
    sglang = SERVICES["sglang"]
    assert SERVICES["generate"]["depends_on"]["sglang"]["condition"] == "service_healthy"
    assert "/health_generate" in " ".join(sglang["healthcheck"]["test"])
    server = options_of(regen_services()["generate"])["--server"]
    port = options_of(as_argv(sglang["command"]))["--port"]
    assert server == f"${{SGLANG_URL:-http://sglang:{port}}}"
    assert "--enable-metrics" in as_argv(sglang["command"])
    (device,) = sglang["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"]


def test_every_metrics_port_is_published() -> None:
    for name, argv in regen_services().items():
        port = options_of(argv).get("--metrics-port")
        if port is not None:
            published = [str(p) for p in SERVICES[name].get("ports", [])]
            assert any(p.endswith(f":{port}") for p in published), (name, published)
    assert {"generate", "tokenize"} <= {
        name for name, argv in regen_services().items() if "--metrics-port" in argv
    }


def test_regen_environment_variables_are_ones_the_code_reads() -> None:
    source = "\n".join(
        path.read_text() for package in PACKAGES for path in (REPO / package).rglob("*.py")
    )
    for name in regen_services():
        for variable in SERVICES[name].get("environment", {}):
            if variable.startswith("REGEN_"):
                assert f'"{variable}"' in source, f"{name}: nothing reads {variable}"


def test_the_optional_router_fronts_the_sglang_server_with_flags_it_accepts() -> None:
    router = SERVICES["router"]
    assert router["profiles"] == ["router"]
    assert router["depends_on"]["sglang"]["condition"] == "service_healthy"
    argv = as_argv(router["command"])
    assert argv[:3] == ["python3", "-m", "sglang_router.launch_router"]
    options = options_of(argv)
    sglang_port = options_of(as_argv(SERVICES["sglang"]["command"]))["--port"]
    assert options["--worker-urls"] == f"http://sglang:{sglang_port}"
    assert options["--policy"] == "cache_aware"
    # A wedged SGLang server passes /health (docs/design/sglang.md, "SGLang contract").
    assert options["--health-check-endpoint"] == "/health_generate"
    published = [str(p) for p in router["ports"]]
    assert any(p.endswith(f":{options['--port']}") for p in published), published
    assert any(p.endswith(f":{options['--prometheus-port']}") for p in published), published
    assert f"localhost:{options['--port']}/readiness" in " ".join(router["healthcheck"]["test"])
    # The router's own parser, where it is installed (the dev extra): every flag exists.
    launcher = pytest.importorskip("sglang_router.launch_router")
    args = launcher.parse_router_args(argv[3:])
    assert args.worker_urls == [options["--worker-urls"]]


# --- the `monitoring` profile (deploy/monitoring/) ----------------------------------------

MONITORING = REPO / "deploy" / "monitoring"


def test_every_named_volume_and_dependency_exists_in_every_profile() -> None:
    """What `docker compose --profile ... config` checks of the references between
    services, for every profile at once (no Docker engine where the tests run)."""
    for name, service in SERVICES.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in SERVICES, (name, dependency)
        for volume in service.get("volumes", []):
            source = str(volume).split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), (name, source)
            elif not source.startswith(("$", "/")):
                assert source in COMPOSE["volumes"], (name, source)


def _mounts(service: str) -> dict[str, Path]:
    """Container path -> repository path of a service's bind mounts from the repository."""
    out = {}
    for volume in SERVICES[service]["volumes"]:
        source, target, *_ = str(volume).split(":")
        if source.startswith("./"):
            out[target] = REPO / source
    return out


def test_the_monitoring_profile_runs_prometheus_grafana_and_the_job_metrics() -> None:
    for name in ("metrics", "prometheus", "grafana"):
        assert SERVICES[name]["profiles"] == ["monitoring"], name
    assert regen_services()["metrics"][1:3] == ["metrics", "serve"]
    port = options_of(regen_services()["metrics"])["--port"]
    assert any(str(p).endswith(f":{port}") for p in SERVICES["metrics"]["ports"])
    # Prometheus reads the mounted config, and the rule files beside it.
    prometheus = _mounts("prometheus")
    (config_flag,) = [a for a in SERVICES["prometheus"]["command"] if "--config.file=" in a]
    config_path = config_flag.split("=", 1)[1]
    assert prometheus[config_path] == MONITORING / "prometheus.yaml"
    config = yaml.safe_load(prometheus[config_path].read_text())
    for rules in config["rule_files"]:
        assert prometheus[str(Path(config_path).parent / rules)] == MONITORING / rules


def test_prometheus_scrapes_every_metrics_port_of_the_compose_file() -> None:
    config = yaml.safe_load((MONITORING / "prometheus.yaml").read_text())
    targets = set()
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            targets.update(static["targets"])
        for dns in job.get("dns_sd_configs", []):
            targets.update(f"{name}:{dns['port']}" for name in dns["names"])
        # regen_* series keep the regen job's name in `job` (the alert rules rely on it).
        assert job.get("honor_labels", False) == job["job_name"].startswith("regen"), job
    argv = regen_services()
    expected = {
        f"generate:{options_of(argv['generate'])['--metrics-port']}",
        f"tokenize:{options_of(argv['tokenize'])['--metrics-port']}",
        f"metrics:{options_of(argv['metrics'])['--port']}",
        f"sglang:{options_of(as_argv(SERVICES['sglang']['command']))['--port']}",
    }
    assert targets == expected


def test_grafana_is_provisioned_with_the_data_source_and_dashboards_regen_ships() -> None:
    grafana = _mounts("grafana")
    provisioning = "/etc/grafana/provisioning"
    (source,) = yaml.safe_load(
        (grafana[f"{provisioning}/datasources"] / "datasource.yaml").read_text()
    )["datasources"]
    assert source["url"] == "http://prometheus:9090"
    assert any(str(p).endswith(":9090") for p in SERVICES["prometheus"]["ports"])
    (provider,) = yaml.safe_load(
        (grafana[f"{provisioning}/dashboards"] / "dashboard.yaml").read_text()
    )["providers"]
    folder = grafana[provider["options"]["path"]]
    dashboards = [json.loads(path.read_text()) for path in folder.glob("*.json")]
    assert [d["uid"] for d in dashboards] == ["regen-jobs"]
    for panel in dashboards[0]["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == source["uid"], panel["title"]


# --- the `ha` profile: Redis Sentinel (docs/operations.md, "Redis Sentinel") ----------------


def test_the_ha_profile_runs_a_replica_with_the_primarys_settings_and_three_sentinels() -> None:
    replica = SERVICES["redis-replica"]
    assert replica["profiles"] == ["ha"]
    primary = as_argv(SERVICES["redis"]["command"])
    argv = as_argv(replica["command"])
    # Every setting of the primary (persistence, noeviction, password), as its replica.
    assert argv[: len(primary)] == primary
    assert options_of(argv)["--replicaof"] == "redis"
    assert "--masterauth" in primary, "a primary that comes back as a replica must log in"
    sentinels = [name for name in SERVICES if name.startswith("sentinel-")]
    assert len(sentinels) == 3
    for name in sentinels:
        service = SERVICES[name]
        assert service["profiles"] == ["ha"]
        conf = "\n".join(as_argv(service["command"]))
        assert re.search(r"sentinel monitor regen redis 6379 2\b", conf), name
        assert "sentinel auth-pass regen $$REDIS_PASSWORD" in conf, name
        assert "redis-sentinel" in conf, name


def test_regen_services_can_be_pointed_at_the_sentinels() -> None:
    for name in regen_services():
        env = SERVICES[name]["environment"]
        assert env["REGEN_REDIS_URL"].startswith("${REGEN_REDIS_URL:-redis://"), name
        assert env["REGEN_REDIS_SENTINEL_MASTER"] == "${REGEN_REDIS_SENTINEL_MASTER:-}", name
    flower_config = COMPOSE["configs"]["flower-celeryconfig"]["content"]
    assert 'broker_transport_options["master_name"]' in flower_config
