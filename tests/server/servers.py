"""The servers the server tests start on 127.0.0.1 (the fixtures that start them are in conftest.py).

`InProcessServer` runs the app in-process under uvicorn; `ModelServer` launches
`python -m kvserve.server serve` as a subprocess with the real default model. Test modules import
these from here (`from servers import ...`): a module named `conftest` is ambiguous when several
test folders run in one pytest process.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
from typing import Self

import httpx
import uvicorn

from kvserve.bench.serve_launch import stop_process
from kvserve.server.app import create_app
from kvserve.server.settings import ServerSettings
from kvserve.server.stores.keys import KeyStore

REPO = pathlib.Path(__file__).resolve().parents[2]
ENGINE_CLIENTS = ("inproc", "process")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_keys(data_dir: pathlib.Path, *names: str) -> dict[str, str]:
    """One API key per name in the data dir's key store, before a server opens it: name -> key."""
    store = KeyStore(data_dir / "kvserve.db")
    try:
        return {name: store.create(name) for name in names}
    finally:
        store.close()


def tiny_model(path: pathlib.Path, ctx: int = 512, **kw) -> pathlib.Path:
    """A tiny random GGUF model (tests/model/ggufmaker.py) for the in-process tests."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "model"))
    from ggufmaker import make_tiny_llama_gguf

    return make_tiny_llama_gguf(path, ctx=ctx, **kw)


def loaded(srv: InProcessServer) -> InProcessServer:
    """An in-process server once its model answers /health."""
    deadline = time.monotonic() + 120
    while httpx.get(srv.base_url + "/health").status_code != 200:
        assert time.monotonic() < deadline, "the tiny model did not load"
        time.sleep(0.1)
    return srv


def engine_server(tmp_path_factory, model_server, name: str, engine_kind: str, *args: str):
    """A module fixture's model server (`yield from` it) on `engine_kind`, stopped when the fixture
    ends: a module parametrized by engine then holds one model at a time."""
    server = model_server(tmp_path_factory.mktemp(f"{name}-{engine_kind}"), *args, engine=engine_kind)
    yield server
    server.stop()


@contextlib.contextmanager
def tiny_model_server(root: pathlib.Path, name: str = "tiny", ctx: int = 1024, **model_kw):
    """An in-process server on a tiny random model (`tiny_model`) served as `name`, once loaded;
    no semantic cache."""
    tiny = tiny_model(root / "tiny.gguf", ctx=ctx, **model_kw)
    settings = ServerSettings(model=str(tiny), served_model_name=name, data_dir=root, semantic_cache=False)
    with InProcessServer(settings) as s:
        yield loaded(s)


class InProcessServer:
    def __init__(self, settings: ServerSettings):
        self.app = create_app(None, settings)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def state(self):
        return self.app.state.server

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)



class ModelServer:
    """`python -m kvserve.server serve` in a subprocess, with the real default model."""

    def __init__(self, data_dir: pathlib.Path, *args: str, engine: str = "inproc"):
        assert engine in ENGINE_CLIENTS, engine
        self.data_dir = data_dir
        self.engine = engine
        self.args = args + (("--engine-process",) if engine == "process" else ())
        if "--semantic-cache" not in args:   # tests of other features expect every request to run the model
            self.args += ("--semantic-cache", "off")
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = data_dir / f"server-{self.port}.log"

    def start(self, timeout: float = 600, *, wait_for_model: bool = True) -> ModelServer:
        """Start the server and wait until /health is 200 (or, without `wait_for_model`, until it
        answers at all: the gateway is up and the model still loading)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.server", "serve", "--port", str(self.port),
             "--data-dir", str(self.data_dir), *self.args],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = httpx.get(self.base_url + "/health", timeout=2)
                if r.status_code == 200 or not wait_for_model:
                    return self
                if r.json().get("status") == "error":   # the model failed to load, or the engine died
                    raise RuntimeError(f"server unhealthy: {r.text}: {self.log_path.read_text()[-3000:]}")
            time.sleep(0.25)
        raise RuntimeError(f"server not healthy in {timeout}s: {self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc:
            stop_process(self.proc)
        if getattr(self, "_log", None):
            self._log.close()

    def access_log(self) -> list[str]:
        return [line for line in self.log_path.read_text().splitlines() if line.startswith('{"ts"')]

    def logged(self, match, timeout: float = 20.0) -> list[dict]:
        """The access log's entries for which `match(entry)` holds, waiting up to `timeout` seconds
        for one: a line is written after the response is sent, so it may lag the client."""
        import json
        import time

        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in map(json.loads, self.access_log()) if match(e)]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.1)


HARDENED_SHARED_PROMPT = (
    "You are the help desk of the Example Library. Answer in one short sentence, politely, and never "
    "make up opening hours, fees or titles that are not in the catalogue.")
