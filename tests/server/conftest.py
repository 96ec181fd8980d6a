"""Real servers on 127.0.0.1 for the server tests.

`gateway` runs the app in-process under uvicorn with no model (auth, validation, limits);
`model_server` launches `python -m kvserve.server serve` as a subprocess with the real
default model, and waits for /health to turn 200. Its semantic cache is off unless the test
passes `--semantic-cache` (tests of other features send the same prompt twice and expect the
model to answer both).

The model-server tests run once per engine client: a module-scoped fixture that takes
`engine_kind` ("inproc": the engine core in a thread of the server; "process": the engine in its
own process, `serve --engine-process`) is set up once per kind, and pytest runs all of a module's
tests against one server before starting the next.
"""

from __future__ import annotations

import pathlib

import pytest
from servers import ENGINE_CLIENTS, HARDENED_SHARED_PROMPT, InProcessServer, ModelServer

from kvserve.server.settings import ServerSettings


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """A real HTTP server with the gateway only (no model): generation endpoints answer 503."""
    settings = ServerSettings(load_model=False, data_dir=tmp_path_factory.mktemp("gw"))
    with InProcessServer(settings) as srv:
        yield srv


@pytest.fixture(scope="module", params=("embedded", "shared"))
def gateway_on_each_backend(request, tmp_path_factory):
    """The gateway (no model) on the embedded stores, then on PostgreSQL + Redis (real servers);
    a module that wants its tests run on both overrides `gateway` with it."""
    settings = ServerSettings(load_model=False, data_dir=tmp_path_factory.mktemp("gw"))
    if request.param == "shared":
        settings.database_url = request.getfixturevalue("postgres_server").new_database()
        settings.redis_url = request.getfixturevalue("redis_server").fresh_url()
    with InProcessServer(settings) as srv:
        yield srv


@pytest.fixture(scope="module", params=ENGINE_CLIENTS)
def engine_kind(request) -> str:
    """Which engine client a module's model server uses; every dependent test runs with each."""
    return request.param


@pytest.fixture(scope="session")
def model_server():
    """Factory: `model_server(data_dir, *cli_args, engine="inproc"|"process")` starts a ModelServer;
    all are stopped at the end."""
    started: list[ModelServer] = []

    def make(data_dir: pathlib.Path, *args: str, engine: str = "inproc") -> ModelServer:
        server = ModelServer(data_dir, *args, engine=engine)
        started.append(server)
        return server.start()

    make.started = started
    yield make
    for server in started:
        server.stop()


@pytest.fixture(scope="module", autouse=True)
def _stop_the_modules_servers(model_server):
    """The servers a module started stop when the module ends (each holds a model, about 1 GB, and
    its threads), except a session fixture's (`keep`)."""
    first = len(model_server.started)
    yield
    for server in model_server.started[first:]:
        if not getattr(server, "keep", False):
            server.stop()


@pytest.fixture(scope="session")
def hardened_server(tmp_path_factory, model_server) -> ModelServer:
    """One server for test_hardening.py and test_fuzz_api.py: the real model, a context of 512,
    a declared shared prompt, a 1 s header timeout, and keys (`server.keys`: a, b, c, limited
    at 4 requests/minute, fuzz)."""
    from kvserve.server.stores.keys import KeyStore

    data_dir = tmp_path_factory.mktemp("hardened")
    store = KeyStore(data_dir / "kvserve.db")
    keys = {"a": store.create("tenant-a"), "b": store.create("tenant-b"), "c": store.create("tenant-c"),
            "limited": store.create("limited", rpm=4), "fuzz": store.create("fuzz")}
    store.close()
    server = model_server(data_dir, "--max-model-len", "512", "--shared-prompt", HARDENED_SHARED_PROMPT,
                          "--header-timeout", "1")
    server.keys = keys
    server.keep = True          # shared by two modules: stopped at the end of the session
    return server


# ---- shared state: real Redis and PostgreSQL (state_servers.py) ------------------------------

@pytest.fixture(scope="session")
def redis_server():
    from state_servers import RedisServer, Unavailable

    try:
        server = RedisServer()
    except Unavailable as e:
        pytest.skip(f"no Redis: {e}")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres_server():
    from state_servers import PostgresServer, Unavailable

    try:
        server = PostgresServer()
    except Unavailable as e:
        pytest.skip(f"no PostgreSQL: {e}")
    yield server
    server.stop()


KEY_BACKENDS = ("sqlite", "postgres", "postgres+redis")


class KeyStores:
    """Opens connections to one key store of the given backend, as the server and the CLI each do."""

    def __init__(self, backend: str, tmp_path: pathlib.Path, request):
        self.backend = backend
        self.db_path = tmp_path / "kvserve.db"
        self.database_url = request.getfixturevalue("postgres_server").new_database() if "postgres" in backend else None
        self.redis_url = request.getfixturevalue("redis_server").fresh_url() if "redis" in backend else None
        self.opened: list = []

    def open(self):
        from kvserve.server.stores.factory import open_key_backend

        store = open_key_backend(self.db_path, self.database_url, self.redis_url)
        self.opened.append(store)
        return store

    def cli_args(self) -> list[str]:
        args = ["--data-dir", str(self.db_path.parent)]
        if self.database_url:
            args += ["--database-url", self.database_url]
        if self.redis_url:
            args += ["--redis-url", self.redis_url]
        return args

    def raw(self) -> bytes:
        """Everything the store has written, as bytes (to check what is never stored)."""
        if self.database_url is None:
            return b"".join(p.read_bytes() for p in self.db_path.parent.iterdir() if p.is_file())
        import psycopg

        with psycopg.connect(self.database_url) as conn:
            rows = [conn.execute(f"SELECT * FROM {t}").fetchall() for t in ("api_keys", "usage_ledger")]
        return repr(rows).encode()


@pytest.fixture(params=KEY_BACKENDS)
def key_stores(request, tmp_path):
    """A `KeyStores` for each key backend: SQLite, PostgreSQL, PostgreSQL behind the Redis cache."""
    stores = KeyStores(request.param, tmp_path, request)
    yield stores
    for store in stores.opened:
        store.close()


@pytest.fixture(params=("memory", "redis"))
def make_limiter(request):
    """Factory of rate limiters for each backend; with Redis every one made shares the buckets
    (as replicas do), each through its own client."""
    from kvserve.server.gates.ratelimit import RateLimiter

    if request.param == "memory":
        shared = RateLimiter()
        yield lambda: shared
        return
    from kvserve.server.stores.redis_state import RedisRateLimiter, connect_redis

    url = request.getfixturevalue("redis_server").fresh_url()
    clients: list = []

    def make():
        clients.append(connect_redis(url))
        return RedisRateLimiter(clients[-1])

    yield make
    for client in clients:
        client.close()
