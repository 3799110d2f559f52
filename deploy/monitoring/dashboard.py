"""Builds grafana/dashboards/json/regen-dashboard.json, regen's Grafana dashboard.

The JSON is generated, never edited by hand: change a panel here and rerun
    python deploy/monitoring/dashboard.py
tests/ops/test_monitoring.py fails while the checked-in JSON differs from what this writes,
and its scrape test runs every panel's query against a real Prometheus scraping a
running job (docs/design/limits.md, Monitoring).

Metric names: regen_job_* and regen_redis_* come from `regen metrics serve`
(regen/ops/job_metrics.py), regen_sglang_server_* from each generate worker
(consumers/generate/metrics.py), sglang:* from each SGLang server's own /metrics.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "grafana" / "dashboards" / "json" / "regen-dashboard.json"
UID = "regen-jobs"
# The data source grafana/datasources/datasource.yaml provisions.
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}
JOB = 'job=~"$job"'
# Wide enough for several scrapes at the default 15 s interval.
RATE = "5m"
WIDTH = 24  # Grafana's grid


@dataclass(frozen=True)
class Panel:
    title: str
    # (PromQL, legend) pairs.
    queries: list[tuple[str, str]]
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 8
    height: int = 8
    description: str = ""
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    title: str
    panels: list[Panel]


ROWS = [
    Row("Progress", [
        Panel("Done", [(f'regen_job_prompts{{{JOB}, place="done"}} / ignoring (place) '
                        f"regen_job_prompts_enqueued{{{JOB}}}", "{{job}}")],
              unit="percentunit", kind="stat", width=4,
              description="Prompts in a shard, of those enqueued."),
        Panel("ETA", [(f"regen_job_eta_seconds{{{JOB}}}", "{{job}}")], unit="s", kind="stat",
              width=4, description="At the rate of the last 10 minutes (regen status)."),
        Panel("Prompts by place", [(f"regen_job_prompts{{{JOB}}}", "{{job}} {{place}}"),
                                   (f"regen_job_prompts_enqueued{{{JOB}}}", "{{job}} enqueued")],
              width=16),
        Panel("Prompts/s", [(f"rate(regen_job_committed_prompts_total{{{JOB}}}[{RATE}])",
                             "{{job}}")], unit="reqps", width=12),
        Panel("Output tokens/s",
              [(f"rate(regen_job_committed_output_tokens_total{{{JOB}}}[{RATE}])", "{{job}}")],
              width=12),
    ]),
    Row("Servers", [
        Panel("Running requests", [("sum by (instance) (sglang:num_running_reqs)",
                                    "{{instance}}")],
              description="SGLang's own metric, per server."),
        Panel("Queued requests", [("sum by (instance) (sglang:num_queue_reqs)",
                                   "{{instance}}")]),
        Panel("KV cache token usage", [("max by (instance) (sglang:token_usage)",
                                        "{{instance}}")], unit="percentunit"),
        Panel("In flight and its limit, per worker and server", [
            ("regen_sglang_server_inflight", "{{instance}} -> {{server}} in flight"),
            ("regen_sglang_server_inflight_limit",
             "{{instance}} -> {{server}} limit ({{reason}})"),
        ], width=24, description="The limit --max-inflight auto chose, and why it last moved."),
    ]),
    Row("Dead letters", [
        Panel("Dead-lettered prompts by stage and reason",
              [(f"regen_job_dead_lettered_prompts{{{JOB}}}", "{{job}} {{stage}} {{reason}}")],
              width=16),
        Panel("Dead letters of no prompt",
              [(f"regen_job_dead_letters_without_prompt{{{JOB}}}", "{{job}} {{reason}}")],
              width=8, description="Dataset rows that gave no prompt, malformed chunks."),
    ]),
    Row("Fleet", [
        Panel("Live workers per host",
              [('sum by (host, kind) (regen_workers{state="live"})', "{{host}} {{kind}}"),
               ('sum by (host, kind) (regen_workers{state="stale"})',
                "{{host}} {{kind}} stale")]),
        Panel("Redis memory", [("regen_redis_used_memory_bytes", "used"),
                               ("regen_redis_maxmemory_bytes", "maxmemory (0: none)")],
              unit="bytes"),
        Panel("Shard bytes and free disk", [
            (f"regen_job_shard_bytes{{{JOB}}}", "{{job}} written"),
            (f"regen_job_remaining_shard_bytes{{{JOB}}}", "{{job}} still to write"),
            (f"regen_job_free_disk_bytes{{{JOB}}}", "{{job}} free at the out dir"),
        ], unit="bytes"),
    ]),
]  # fmt: skip


def _panel(panel: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": panel.options,
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": expr,
                "legendFormat": legend,
            }
            for i, (expr, legend) in enumerate(panel.queries)
        ],
    }


def build() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    for row in ROWS:
        panels.append({"id": len(panels) + 1, "type": "row", "title": row.title,
                       "collapsed": False, "gridPos": {"h": 1, "w": WIDTH, "x": 0, "y": y},
                       "panels": []})  # fmt: skip
        y += 1
        x = 0
        for panel in row.panels:
            if x + panel.width > WIDTH:
                x, y = 0, y + panel.height
            panels.append(_panel(panel, len(panels) + 1, x, y))
            x += panel.width
        y += max(p.height for p in row.panels)
    return {
        "uid": UID,
        "title": "regen jobs",
        "tags": ["regen"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "job",
                    "label": "job",
                    "type": "query",
                    "datasource": DATASOURCE,
                    "query": {
                        "query": "label_values(regen_job_prompts_enqueued, job)",
                        "refId": "jobs",
                    },
                    "refresh": 2,
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                }
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
