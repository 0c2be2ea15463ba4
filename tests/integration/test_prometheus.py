"""A real Prometheus (Debian's `prometheus`) scrapes live verifier and replay servers through their bearer
token, using deploy/monitoring/prometheus.yml with only the targets and the token path swapped for this
test's; every query of the Grafana dashboard then runs through its HTTP API."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import yaml

from tests.conftest import REPO_ROOT, free_port
from tests.unit.test_deploy_monitoring import dashboard_queries

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SHIPPED_CONFIG = REPO_ROOT / "deploy" / "monitoring" / "prometheus.yml"
# Prometheus 2.42 starts in ~1 s here; the first scrape follows one scrape interval later.
START_TIMEOUT_S = 60.0
SCRAPE_INTERVAL = "1s"


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: install Debian's `prometheus` package (scripts/system-deps.sh)")
    return path


def live_config(targets: dict[str, str], token_file) -> dict:
    """The shipped config, scraping only the jobs in `targets` (job name -> host:port) with `token_file`."""
    config = yaml.safe_load(SHIPPED_CONFIG.read_text())
    config["global"]["scrape_interval"] = SCRAPE_INTERVAL
    jobs = []
    for job in config["scrape_configs"]:
        if job["job_name"] in targets:
            job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
            job["authorization"]["credentials_file"] = str(token_file)
            jobs.append(job)
    assert len(jobs) == len(targets), "the shipped config lost a job this test scrapes"
    config["scrape_configs"] = jobs
    return config


def api(port: int, path: str, **params) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as reply:
        body = json.load(reply)
    assert body["status"] == "success", body
    return body["data"]


def wait_for_targets_up(port: int, process: subprocess.Popen, jobs: set[str]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    health: dict = {}
    while time.monotonic() < deadline:
        assert process.poll() is None, f"prometheus exited with {process.returncode}"
        try:
            active = api(port, "targets")["activeTargets"]
            health = {t["labels"]["job"]: (t["health"], t.get("lastError")) for t in active}
            if {job for job, (state, _) in health.items() if state == "up"} == jobs:
                return
        except OSError:
            pass  # not listening yet
        time.sleep(0.5)
    pytest.fail(f"targets not all up within {START_TIMEOUT_S} s: {health}")


@pytest.fixture(scope="module")
def prometheus(verifier, replay, verifier_client, auth_token_file, tmp_path_factory):
    # Traffic first, so the counters checked below are non-zero at the first scrape.
    assert verifier_client.verify([(r"so \boxed{4}", "4")])[0].reward == 1.0
    workdir = tmp_path_factory.mktemp("prometheus")
    targets = {"rlep-verifier": f"127.0.0.1:{verifier.metrics_port}", "rlep-replay": f"127.0.0.1:{replay.metrics_port}"}
    config_file = workdir / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(live_config(targets, auth_token_file)))
    check = subprocess.run(
        [binary("promtool"), "check", "config", str(config_file)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    log = (workdir / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            binary("prometheus"),
            f"--config.file={config_file}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for_targets_up(port, process, set(targets))
        yield port
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def wait_for_series(port: int, query: str, timeout_s: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = api(port, "query", query=query)["result"]
        if result:
            return result
        time.sleep(0.5)
    pytest.fail(f"no series for {query} within {timeout_s} s")


@pytest.mark.parametrize("service", ["verifier", "replay"])
def test_prometheus_stores_the_services_series_with_their_service_label(prometheus, service):
    result = wait_for_series(prometheus, f'{{__name__=~"rlep_{service}_.+"}}')
    names = {series["metric"]["__name__"] for series in result}
    assert {series["metric"].get("service") for series in result} == {service}
    expected = {
        "verifier": {"rlep_verifier_items_total", "rlep_verifier_request_seconds_bucket", "rlep_verifier_workers"},
        "replay": {"rlep_replay_trajectories_added_total", "rlep_replay_sample_seconds_count"},
    }[service]
    assert expected <= names, sorted(names)


def test_counters_carry_the_traffic_sent_before_the_scrape(prometheus):
    correct = 'rlep_verifier_items_total{verdict="correct", scorer="default", service="verifier"}'
    [series] = wait_for_series(prometheus, correct)
    assert float(series["value"][1]) >= 1
    [workers] = wait_for_series(prometheus, "rlep_verifier_workers")
    assert float(workers["value"][1]) == 2


def test_every_dashboard_query_is_valid_promql(prometheus):
    for title, expr, _ in dashboard_queries():
        # Grafana fills in $__rate_interval; Prometheus rejects a query it cannot parse with HTTP 400.
        query = expr.replace("$__rate_interval", "1m")
        try:
            api(prometheus, "query", query=query)
        except urllib.error.HTTPError as err:
            pytest.fail(f"panel {title!r}: Prometheus rejected {query!r}: {err.read().decode()}")
