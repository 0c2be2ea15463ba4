"""docker-compose.yml validates with Debian's `docker-compose config` (no engine needed) and wires what the
services need: health checks, one config directory, the token as a secret; the Dockerfile copies what exists."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis
import yaml

from rlep.common.redis_server import redis_server_binary
from tests.conftest import REPO_ROOT, free_port

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DOCKERFILE = REPO_ROOT / "deploy" / "docker" / "Dockerfile"
RLEP_SERVICES = {"verifier", "replay", "rollout", "eval", "learner", "sandbox"}
TOKEN = "/run/secrets/rlep_auth_token"


@pytest.fixture(scope="module")
def compose() -> dict:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail("docker-compose not found: install Debian's `docker-compose` package (scripts/system-deps.sh)")
    result = subprocess.run(
        [binary, "-f", str(COMPOSE_FILE), "config"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def flags(service: dict) -> dict[str, str]:
    """`--name=value` arguments of a service's command (the `--set` overrides are in `overrides`)."""
    return dict(arg[2:].split("=", 1) for arg in service["command"] if arg.startswith("--") and "=" in arg)


def overrides(service: dict) -> dict[str, str]:
    return dict(arg.removeprefix("--set=").split("=", 1) for arg in service["command"] if arg.startswith("--set="))


def mounts(service: dict) -> dict[str, tuple[str, str]]:
    """target -> (source, mode); docker-compose 1.29 prints volumes as `source:target:mode`."""
    return {target: (source, mode) for source, target, mode in (v.split(":") for v in service["volumes"])}


def test_every_component_is_there_with_a_health_check(compose):
    services = compose["services"]
    assert set(services) == RLEP_SERVICES | {"redis", "prometheus", "grafana"}
    for name, service in services.items():
        assert service["healthcheck"]["test"][0] == "CMD", name


def test_redis_keeps_an_fsynced_append_only_file(compose):
    command = compose["services"]["redis"]["command"][2].split()  # sh -c "exec redis-server - --appendonly ..."
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "always"


def test_rlep_services_listen_on_all_interfaces_with_the_shared_config_and_token(compose):
    # The learner is a client (no --host); its endpoints are checked in the next test.
    for name in RLEP_SERVICES - {"learner"}:
        service = compose["services"][name]
        options = flags(service)
        assert options["host"] == "0.0.0.0", name
        assert options["auth-token-file"] == TOKEN, name
        config = options["config"]
        assert config.startswith("/etc/rlep/"), name
        assert (REPO_ROOT / "configs" / config.removeprefix("/etc/rlep/")).is_file(), f"{name}: {config} missing"
        assert service["secrets"][0]["source"] == "rlep_auth_token", name
        assert mounts(service)["/etc/rlep"] == (str(REPO_ROOT / "configs"), "ro"), name


def test_health_checks_use_the_image_script_on_each_service_port(compose):
    # gRPC services are checked on their health port (--health-port), which their command opens.
    health_ports = {"verifier": 50071, "replay": 50072, "rollout": 50073, "sandbox": 50074}
    for name, port in health_ports.items():
        assert flags(compose["services"][name])["health-port"] == str(port), name
    ports = {name: f"grpc 127.0.0.1:{port}" for name, port in health_ports.items()}
    ports |= {"eval": "http http://127.0.0.1:8080/healthz", "learner": "http http://127.0.0.1:9464/healthz"}
    for name, target in ports.items():
        test = compose["services"][name]["healthcheck"]["test"]
        assert test[1:3] == ["python", "/opt/rlep/healthcheck.py"] and " ".join(test[3:]) == target, name
    assert "COPY deploy/docker/healthcheck.py /opt/rlep/healthcheck.py" in DOCKERFILE.read_text()


def test_services_reach_each_other_by_compose_name(compose):
    services = compose["services"]
    env = services["eval"]["environment"]
    assert yaml.safe_load(env["RLEP_EVAL__ROLLOUT__ADDRESSES"]) == ["rollout:50063"]
    assert env["RLEP_EVAL__VERIFIER__ADDRESS"] == "verifier:50061"
    learner = flags(services["learner"])
    assert learner["config"] == "/etc/rlep/train.yaml"
    assert overrides(services["learner"]) == {
        "endpoints.rollout": "[rollout:50063]",
        "endpoints.verifier": "verifier:50061",
        "endpoints.replay": "replay:50062",
        "endpoints.sandbox": "sandbox:50064",
        "endpoints.auth_token_file": TOKEN,
        "checkpoint.dir": "/checkpoints",
        "metrics_host": "0.0.0.0",
        "metrics_port": "9464",
        "metrics_linger_s": "30",
    }


def test_only_the_sandbox_runs_without_dockers_seccomp_profile(compose):
    """bubblewrap needs user namespaces, which Docker's default seccomp profile refuses; no other service gets that."""
    unconfined = {name for name, service in compose["services"].items() if service.get("security_opt")}
    assert unconfined == {"sandbox"}
    assert "seccomp=unconfined" in compose["services"]["sandbox"]["security_opt"]
    assert "bubblewrap" in DOCKERFILE.read_text()


def test_the_learner_job_outlives_its_last_step_by_more_than_a_scrape_interval(compose):
    """A short learner job's final figures reach Prometheus (metrics_linger_s against scrape_interval)."""
    command = compose["services"]["learner"]["command"]
    linger = float(next(arg for arg in command if arg.startswith("--set=metrics_linger_s=")).split("=")[-1])
    prometheus = yaml.safe_load((REPO_ROOT / "deploy/monitoring/prometheus.yml").read_text())
    interval = float(prometheus["global"]["scrape_interval"].removesuffix("s"))
    assert linger > interval


def test_prometheus_and_grafana_mount_the_shipped_monitoring_files(compose):
    mounted = [source for name in ("prometheus", "grafana") for source, _ in mounts(compose["services"][name]).values()]
    local = [source for source in mounted if source.startswith("/")]
    assert len(local) == 3 and all(Path(source).exists() for source in local), local
    assert compose["services"]["prometheus"]["secrets"][0]["source"] == "rlep_auth_token"


def test_dockerfile_copies_only_what_exists_and_installs_like_bootstrap():
    text = DOCKERFILE.read_text()
    sources = [s for line in re.findall(r"^COPY (.+)$", text, re.M) for s in line.split()[:-1]]
    assert sources, "no COPY lines found"
    for source in sources:
        assert (REPO_ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"
    ignore = (REPO_ROOT / "deploy/docker/Dockerfile.dockerignore").read_text().splitlines()
    for source in sources:
        assert f"!{source.rstrip('/')}" in {line.rstrip("/") for line in ignore}, f"{source} excluded by dockerignore"
    assert "scripts/bootstrap.sh" in text and "torch==2.13.0+cpu" in text


def shell(text: str) -> str:
    """`docker-compose config` prints a literal `$` as `$$`; the container's shell sees one."""
    return text.replace("$$", "$")


def test_redis_requires_the_password_from_its_secret(compose, tmp_path):
    """Runs compose's own Redis command and health check (with the real redis-server) against a temp secret."""
    service = compose["services"]["redis"]
    assert [s["source"] for s in service["secrets"]] == ["redis_password"]
    secret = tmp_path / "redis_password"
    secret.write_text("0123abcd\n")
    port = free_port()
    script = shell(service["command"][2]).replace("/run/secrets/redis_password", str(secret))
    assert "requirepass" not in script.split("<<")[0]  # on stdin, not on the command line
    script = script.replace("redis-server -", f"{redis_server_binary()} - --port {port} --dir {tmp_path}", 1)
    server = subprocess.Popen(["sh", "-c", script], stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, password="0123abcd", socket_connect_timeout=1)
        deadline = time.monotonic() + 30
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert server.poll() is None and time.monotonic() < deadline, "redis did not start"
                time.sleep(0.05)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        settings = client.config_get("append*")
        assert (settings["appendonly"], settings["appendfsync"]) == ("yes", "always")
        check = shell(service["healthcheck"]["test"][3]).replace("/run/secrets/redis_password", str(secret))
        cli = shutil.which("redis-cli") or str(Path(redis_server_binary()).with_name("redis-cli"))
        check = check.replace("redis-cli ping", f"{cli} -p {port} ping")
        assert subprocess.run(["sh", "-c", check], timeout=30).returncode == 0
        secret.write_text("wrong\n")
        assert subprocess.run(["sh", "-c", check], timeout=30).returncode != 0
    finally:
        server.terminate()  # the script exec'ed redis-server: this is Redis itself
        server.wait(timeout=30)


def test_replay_and_eval_get_the_redis_url_with_its_password(compose, tmp_path):
    secret = tmp_path / "redis_password"
    secret.write_text("0123abcd\n")
    for name, variable in (("replay", "RLEP_REPLAY__REDIS_URL"), ("eval", "RLEP_EVAL__REDIS_URL")):
        service = compose["services"][name]
        assert "redis_password" in [s["source"] for s in service["secrets"]], name
        assert not any("REDIS_URL" in key for key in service.get("environment", {})), name
        entrypoint = [shell(part).replace("/run/secrets/redis_password", str(secret)) for part in service["entrypoint"]]
        shown = subprocess.run([*entrypoint, "env"], capture_output=True, text=True, timeout=30, check=True).stdout
        assert f"{variable}=redis://:0123abcd@redis:6379/0" in shown.splitlines(), name


def test_make_secrets_writes_a_url_safe_redis_password(tmp_path):
    script = tmp_path / "make-secrets.sh"
    shutil.copy(REPO_ROOT / "deploy" / "docker" / "make-secrets.sh", script)
    subprocess.run(["bash", str(script)], capture_output=True, timeout=60, check=True)
    for name in ("auth-token", "redis-password", "grafana-admin-password"):
        assert re.fullmatch(r"[0-9a-f]{64}\n", (tmp_path / "secrets" / name).read_text()), name
