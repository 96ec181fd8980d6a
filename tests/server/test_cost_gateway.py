"""Issue 49.10 on a real gateway (no model): /metrics behind --metrics-key, wrong admin keys
throttled, a database key named api-key never sharing --api-key's identity, secrets read from a
file, Ray's local cluster on loopback, and a 500's log line with its path escaped."""

from __future__ import annotations

import logging
import socket
import sys
import types

import httpx
import pytest
from servers import InProcessServer

from kvserve.errors import InvalidRequest
from kvserve.server.api.lora_admin import ADMIN_FAILURES_PER_MINUTE
from kvserve.server.settings import ServerSettings
from kvserve.server.stores.keys import KeyStore

CLI_KEY, METRICS_KEY, ADMIN_KEY = "cli-secret-key", "metrics-secret", "admin-secret"


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("cost-gw")
    store = KeyStore(data_dir / "kvserve.db")
    user = store.create("user")
    legacy = store.create("legacy")
    with store.db.connection() as conn:   # a key named api-key, from before the name was reserved
        conn.execute("UPDATE api_keys SET name = 'api-key' WHERE name = 'legacy'")
    store.close()
    settings = ServerSettings(load_model=False, data_dir=data_dir, api_key=CLI_KEY, metrics_key=METRICS_KEY,
                              admin_key=ADMIN_KEY)
    srv = InProcessServer(settings)

    async def boom(rest: str):
        raise RuntimeError("boom")
    srv.app.add_api_route("/boom/{rest}", boom)
    srv.app.router.routes.insert(0, srv.app.router.routes.pop())   # before the page's catch-all mount
    with srv:
        srv.user, srv.legacy = user, legacy
        yield srv


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_metrics_needs_the_metrics_key(gw):
    assert httpx.get(gw.base_url + "/metrics", headers=bearer(gw.user)).status_code == 401
    assert httpx.get(gw.base_url + "/metrics", headers=bearer(CLI_KEY)).status_code == 401
    r = httpx.get(gw.base_url + "/metrics", headers=bearer(METRICS_KEY))
    assert r.status_code == 200 and "kvserve" in r.text


def test_a_database_key_named_api_key_is_not_the_cli_key(gw):
    url = gw.base_url + "/v1/kvserve/conversations"
    conv = httpx.post(url, headers=bearer(gw.legacy), json={"title": "mine"}).json()
    assert conv["id"] not in {c["id"] for c in httpx.get(url, headers=bearer(CLI_KEY)).json()["data"]}
    assert conv["id"] in {c["id"] for c in httpx.get(url, headers=bearer(gw.legacy)).json()["data"]}
    with pytest.raises(InvalidRequest, match="reserved"):
        KeyStore(gw.state.settings.db_path).create("api-key")


def test_wrong_admin_keys_are_throttled(gw):
    url, body = gw.base_url + "/v1/unload_lora_adapter", {"lora_name": "x"}
    codes = [httpx.post(url, json=body, headers=bearer(f"guess-{i}")).status_code
             for i in range(ADMIN_FAILURES_PER_MINUTE + 5)]
    assert codes[:ADMIN_FAILURES_PER_MINUTE] == [401] * ADMIN_FAILURES_PER_MINUTE
    assert set(codes[ADMIN_FAILURES_PER_MINUTE:]) == {429}
    r = httpx.post(url, json=body, headers=bearer(ADMIN_KEY))
    assert r.status_code == 429 and "Retry-After" in r.headers   # until the bucket refills, for everyone


def test_a_500_logs_its_path_escaped(gw, caplog):
    """(Starlette's URL drops \\n, \\r and \\t; the other line breaks and escapes reach the log raw.)"""
    raw = (f'GET /boom/x%0A%0B%1B[2J%E2%80%A8{{"forged":1}} HTTP/1.1\r\nHost: x\r\n'   # as an attacker sends it
           f"Authorization: Bearer {gw.user}\r\nConnection: close\r\n\r\n").encode()
    with caplog.at_level(logging.ERROR, logger="kvserve.server"), socket.create_connection(("127.0.0.1", gw.port)) as sock:
        sock.sendall(raw)
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 500")
    lines = [rec.getMessage() for rec in caplog.records if "unhandled error" in rec.getMessage()]
    # line breaks as str.splitlines and log viewers see them, and a terminal escape: all escaped
    assert lines and all(len(line.splitlines()) == 1 and "\x1b" not in line for line in lines), lines


def test_secrets_from_a_file_or_the_environment(tmp_path):
    import typer

    from kvserve.server.cli import _secret, serve

    (tmp_path / "k").write_text("from-file\n")
    assert _secret(None, tmp_path / "k", "--api-key") == "from-file"
    with pytest.raises(typer.Exit):
        _secret("also-given", tmp_path / "k", "--api-key")
    app = typer.Typer()
    app.command()(serve)
    params = {p.name: p for p in typer.main.get_command(app).params}
    assert params["api_key"].envvar == "KVSERVE_API_KEY" and params["admin_key"].envvar == "KVSERVE_ADMIN_KEY"
    assert params["metrics_key"].envvar == "KVSERVE_METRICS_KEY"
    assert {"api_key_file", "admin_key_file", "metrics_key_file"} <= set(params)


def test_a_local_ray_cluster_binds_loopback(monkeypatch):
    from kvserve.engine import ray_cluster

    seen: dict = {}
    fake = types.ModuleType("ray")
    fake.init = lambda **kw: seen.update(kw)
    monkeypatch.setitem(sys.modules, "ray", fake)
    ray_cluster.start_local_cluster(2)
    ray_cluster.HEAD_THREAD_DONE.set()
    assert seen["_node_ip_address"] == "127.0.0.1" and seen.get("include_dashboard") is False
