"""`kvserve serve` at startup, as real processes: a port in use and a model that cannot load each
end the process with one line and a non-zero code, nothing printed as listening first."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from servers import REPO, free_port


def serve(tmp_path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve.server", "serve", "--data-dir", str(tmp_path), *args],
                          cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_port_in_use_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = serve(tmp_path, "--port", str(port), timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and str(port) in lines[0] and "in use" in lines[0], r.stderr
    assert "listening" not in r.stderr + r.stdout


def test_model_that_cannot_load_exits_non_zero(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)   # a header with absurd counts
    r = serve(tmp_path, "--port", str(free_port()), "--model", str(bad))
    assert r.returncode == 1, (r.stdout, r.stderr)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "could not be loaded" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_unreachable_state_store_is_one_line_and_exit_1(tmp_path):
    """--redis-url / --database-url that nothing answers: one line naming the store, no password."""
    dead = free_port()
    r = serve(tmp_path, "--port", str(free_port()), "--redis-url", f"redis://127.0.0.1:{dead}/0",
              "--database-url", f"postgresql://kvserve:s3cret@127.0.0.1:{dead}/kvserve", timeout=120)
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: Cannot reach Redis"), r.stderr
    assert "s3cret" not in r.stderr and "listening" not in r.stderr + r.stdout
