"""Real Redis and PostgreSQL servers for the shared-state tests, on free ports in temp dirs.

`RedisServer` runs Debian's `redis-server` with no persistence; `fresh_url()` hands out one of
its 16 databases, flushed. `PostgresServer` runs `initdb` + `pg_ctl` from PostgreSQL 15 with its
socket in the temp dir and trust auth on 127.0.0.1; `new_database()` creates an empty schema
and returns a URL whose connections use it. PostgreSQL refuses to run as root, so under root both run as `nobody` in a
directory given to it. Either class raises `Unavailable` with a one-line reason when its server
cannot start; the fixtures turn that into a skip.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time


class Unavailable(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise Unavailable("redis-server is not installed (scripts/test-deps.sh installs it)")
        self.dir = tempfile.mkdtemp(prefix="kvserve-redis-")
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--databases", "16"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._dbs = itertools.cycle(range(16))
        import redis

        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis(port=self.port, socket_timeout=1).ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise Unavailable("redis-server did not start") from None
                time.sleep(0.05)

    def fresh_url(self) -> str:
        import redis

        db = next(self._dbs)
        with redis.Redis(port=self.port, db=db) as client:
            client.flushdb()
        return f"redis://127.0.0.1:{self.port}/{db}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class PostgresServer:
    def __init__(self) -> None:
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        if not bins:
            raise Unavailable("PostgreSQL is not installed (scripts/test-deps.sh installs it)")
        self.bin = os.path.dirname(bins[-1])
        self.dir = tempfile.mkdtemp(prefix="kvserve-pg-")
        self.data = os.path.join(self.dir, "data")
        self.port = _free_port()
        self._names = itertools.count()
        self._as: list[str] = []
        if os.geteuid() == 0:   # initdb and postgres refuse root: run them as nobody
            nobody = pwd.getpwnam("nobody")
            os.chown(self.dir, nobody.pw_uid, nobody.pw_gid)
            self._as = ["runuser", "-u", "nobody", "--"]
        try:
            self._run("initdb", "-D", self.data, "-A", "trust", "-U", "kvserve", "-E", "UTF8", "--no-sync")
            self._run("pg_ctl", "-D", self.data, "-l", os.path.join(self.dir, "log"), "-w", "-t", "60", "-o",
                      f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
                      "-c max_connections=200", "start")
        except Unavailable:
            self.stop()
            raise

    def _run(self, tool: str, *args: str) -> None:
        r = subprocess.run([*self._as, os.path.join(self.bin, tool), *args], check=False, capture_output=True, text=True,
                           timeout=120)
        if r.returncode != 0:
            raise Unavailable(f"{tool} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")

    @property
    def admin_url(self) -> str:
        return f"postgresql://kvserve@127.0.0.1:{self.port}/postgres"

    def new_database(self) -> str:
        """The URL of an empty namespace: a new schema, first on the connection's search_path (a
        schema takes milliseconds to create where a database takes a second)."""
        import psycopg

        name = f"t{next(self._names)}"
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {name}")
        return f"postgresql://kvserve@127.0.0.1:{self.port}/postgres?options=-csearch_path%3D{name}"

    def stop(self) -> None:
        if os.path.exists(os.path.join(self.data, "postmaster.pid")):
            with contextlib.suppress(Unavailable, subprocess.TimeoutExpired):
                self._run("pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)
