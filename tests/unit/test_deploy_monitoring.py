"""The Grafana dashboard, the metrics reference and the Prometheus config agree with what the services export.

Exported names come from the services' own metrics classes, instantiated into a fresh registry, so a
renamed series breaks this test rather than a dashboard panel in production.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from tests.conftest import REPO_ROOT

MONITORING = REPO_ROOT / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "rlep.json"
# Labels Prometheus or the services add to every series, besides the ones a metric declares.
COMMON_LABELS = {"service", "instance", "job"}
SERIES_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}


class _NoJobs:
    """Stands in for eval's Redis job store: the gauge callbacks only run at scrape time."""

    def count(self, status) -> int:
        return 0


def _metric_objects(holder) -> list[MetricWrapperBase]:
    found = []
    for value in vars(holder).values():
        values = value.values() if isinstance(value, dict) else [value]
        found += [v for v in values if isinstance(v, MetricWrapperBase)]
    return found


def exported_families() -> dict[str, tuple[str, frozenset[str]]]:
    """Metric family name (`_total` kept on counters) -> (type, label names) over every service."""
    from rlep.services.eval.server import EvalMetrics
    from rlep.services.learner.metrics import LearnerMetrics
    from rlep.services.replay.server import ReplayMetrics
    from rlep.services.rollout.server import RolloutMetrics
    from rlep.services.sandbox.server import SandboxMetrics
    from rlep.services.verifier.server import VerifierMetrics

    services = (VerifierMetrics, ReplayMetrics, RolloutMetrics, LearnerMetrics, SandboxMetrics)
    holders = [cls(CollectorRegistry()) for cls in services]
    holders.append(EvalMetrics(CollectorRegistry(), _NoJobs()))
    families = {}
    for holder in holders:
        for metric in _metric_objects(holder):
            name = metric._name + ("_total" if metric._type == "counter" else "")
            families[name] = (metric._type, frozenset(metric._labelnames))
    return families


def exported_series() -> dict[str, frozenset[str]]:
    """Every series name a scrape can show (`_bucket`, `_sum`, ...) -> the labels it may carry."""
    series = {}
    for name, (kind, labels) in exported_families().items():
        if kind == "counter":
            base = name.removesuffix("_total")
            series |= {base + suffix: labels for suffix in SERIES_SUFFIXES["counter"]}
        elif kind == "histogram":
            series |= {name + suffix: labels for suffix in SERIES_SUFFIXES["histogram"]}
            series[name + "_bucket"] = labels | {"le"}
        else:
            series[name] = labels
    return series


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(panel title, PromQL, legend format) of every query in the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (p["title"], t["expr"], t.get("legendFormat", "")) for p in dashboard["panels"] for t in p.get("targets", [])
    ]


def test_metric_families_are_found():
    # Guards the helper itself: an empty result would make every check below pass vacuously.
    families = exported_families()
    assert {"rlep_verifier_items_total", "rlep_replay_sample_seconds", "rlep_learner_step_seconds"} <= set(families)
    assert {name.split("_")[1] for name in families} == {"verifier", "replay", "rollout", "learner", "eval", "sandbox"}


def test_every_dashboard_query_names_only_exported_series_and_labels():
    series = exported_series()
    queries = dashboard_queries()
    assert len(queries) >= 30
    for title, expr, legend in queries:
        names = set(re.findall(r"\brlep_[a-z0-9_]+", expr))
        assert names, f"panel {title!r}: no rlep_* series in {expr!r}"
        unknown = names - set(series)
        assert not unknown, f"panel {title!r} queries series no service exports: {sorted(unknown)}"
        allowed = COMMON_LABELS.union(*(series[n] for n in names))
        grouped = {label.strip() for group in re.findall(r"\bby \(([^)]*)\)", expr) for label in group.split(",")}
        matched = set(re.findall(r"[{,]\s*([a-z_]+)\s*(?:=|!=|=~|!~)\s*\"", expr))
        legend_labels = set(re.findall(r"\{\{(\w+)\}\}", legend))
        unknown_labels = (grouped | matched | legend_labels) - allowed - {""}
        assert not unknown_labels, f"panel {title!r} uses labels {sorted(unknown_labels)} its series do not carry"


def test_dashboard_covers_every_area_the_issue_names():
    queried = " ".join(expr for _, expr, _ in dashboard_queries())
    wanted = [
        "rlep_learner_fresh_accuracy",
        "rlep_learner_reward_mean",
        "rlep_learner_replayed_fraction",
        "rlep_learner_approx_kl",
        "rlep_learner_clip_fraction",
        "rlep_learner_step_seconds",
        "rlep_rollout_generated_tokens_total",
        "rlep_replay_pool_trajectories",
        "rlep_replay_sample_seconds_bucket",
        "rlep_verifier_items_total",
        'verdict="timeout"',
        "rlep_eval_jobs",
    ]
    assert [w for w in wanted if w not in queried] == []


def test_dashboard_panels_are_laid_out_and_use_the_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "rlep"
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    occupied: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {(grid["x"] + dx, grid["y"] + dy) for dx in range(grid["w"]) for dy in range(grid["h"])}
        assert not cells & occupied, f"panel {panel['title']!r} overlaps another"
        occupied |= cells
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_readme_documents_every_exported_metric_with_its_type_and_labels():
    rows = re.findall(r"^\| `(rlep_[a-z0-9_]+)` \| (\w+) \|([^|]*)\|", (MONITORING / "README.md").read_text(), re.M)
    documented = {name: (kind, frozenset(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}
    assert documented == exported_families()


def test_prometheus_config_scrapes_every_service_with_the_token():
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    assert targets == {
        "rlep-verifier": ["verifier:9461"],
        "rlep-replay": ["replay:9462"],
        "rlep-rollout": ["rollout:9463"],
        "rlep-learner": ["learner:9464"],
        "rlep-eval": ["eval:8080"],
        "rlep-sandbox": ["sandbox:9465"],
    }
    for job in config["scrape_configs"]:
        assert job["authorization"]["credentials_file"] == "/run/secrets/rlep_auth_token", job["job_name"]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: install Debian's `prometheus` package (scripts/system-deps.sh)")
    return path


def test_promtool_accepts_the_shipped_config():
    # --syntax-only: the token file named in it exists only inside the compose container.
    result = subprocess.run(
        [promtool(), "check", "config", "--syntax-only", str(MONITORING / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisioning_points_at_the_compose_prometheus():
    datasources = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    [source] = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/rlep.yml").read_text())
    assert providers["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
