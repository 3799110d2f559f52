"""deploy/monitoring/: the dashboard is what its builder writes and has every panel a
job's operator needs; the alert rules pass promtool's checks and unit tests."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "json" / "regen-dashboard.json"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (Debian: apt-get install prometheus; .ci/run does)",
)


def builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("regen_dashboard", MONITORING / "dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panel_exprs() -> dict[str, list[str]]:
    """Panel title -> its queries."""
    return {
        panel["title"]: [target["expr"] for target in panel["targets"]]
        for panel in dashboard()["panels"]
        if panel["type"] != "row"
    }


def test_the_dashboard_json_is_what_its_builder_writes() -> None:
    assert DASHBOARD.read_text() == builder().render(), (
        "regenerate it: python deploy/monitoring/dashboard.py"
    )


def test_the_dashboard_shows_every_figure_of_a_job() -> None:
    exprs = "\n".join(e for queries in panel_exprs().values() for e in queries)
    wanted = [
        'regen_job_prompts{job=~"$job", place="done"}',  # done over total
        "regen_job_prompts_enqueued",
        "regen_job_eta_seconds",
        "rate(regen_job_committed_prompts_total",  # prompts/s
        "rate(regen_job_committed_output_tokens_total",  # output tokens/s
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",  # KV cache
        "regen_sglang_server_inflight_limit",  # what --max-inflight auto chose
        "regen_job_dead_lettered_prompts",  # by stage and reason
        'regen_workers{state="live"}',  # per host
        "regen_redis_used_memory_bytes",
        "regen_redis_maxmemory_bytes",
        "regen_job_shard_bytes",
        "regen_job_free_disk_bytes",
        "regen_job_remaining_shard_bytes",
    ]
    assert [w for w in wanted if w not in exprs] == []
    ids = [panel["id"] for panel in dashboard()["panels"]]
    assert len(ids) == len(set(ids))


@needs_promtool
@pytest.mark.parametrize(
    "args",
    [
        ["check", "rules", "alerts.yml"],
        ["test", "rules", "alerts_test.yml"],
        ["check", "config", "prometheus.yaml"],
    ],
    ids=" ".join,
)
def test_promtool_accepts_the_rules_and_their_unit_tests(args: list[str]) -> None:
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, *args], cwd=MONITORING, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_every_alert_has_a_unit_test() -> None:
    import yaml

    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    tests = yaml.safe_load((MONITORING / "alerts_test.yml").read_text())["tests"]
    fired = {
        case["alertname"]
        for test in tests
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    assert alerts == fired
