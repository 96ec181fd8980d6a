"""Busy cores beside a benchmark: N processes that spin, as a browser tab, a build or a neighbour's
VM would, so that `kvserve bench latency --busy-cores N` measures a machine that is not quiet.

Each spinner is a plain Python process at normal priority, not pinned (the OS places it, as it
would any neighbour). Its life is bounded three ways: the context manager stops it on exit (also
on an exception or Ctrl-C), it exits by itself after `limit_s`, and it exits within a fraction of
a second once the process that started it is gone (even killed with SIGKILL)."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from typing import Self

# argv: deadline in seconds, parent pid. Checks the clock and the parent every ~2^21 iterations
# (~0.1 s of spinning).
_SPIN = """
import os, sys, time
end = time.monotonic() + float(sys.argv[1]); parent = int(sys.argv[2])
sys.stdout.write("ready\\n"); sys.stdout.flush()
n = 0
while True:
    n += 1
    if not n & 0x1FFFFF and (time.monotonic() > end or os.getppid() != parent):
        break
"""

_live: set[subprocess.Popen] = set()


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:   # pragma: no cover - a kill that did not take
            pass
        _live.discard(p)


atexit.register(lambda: _stop(list(_live)))


class BusyCores:
    """`with BusyCores(n):` n spinning processes for the block (none for n = 0)."""

    def __init__(self, n: int, limit_s: float = 900.0):
        self.n = n
        self.limit_s = limit_s
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Self:
        try:
            for _ in range(self.n):
                p = subprocess.Popen([sys.executable, "-I", "-c", _SPIN, str(self.limit_s), str(os.getpid())],
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
                self.procs.append(p)
                _live.add(p)
            for p in self.procs:   # spinning before the measurement starts
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"busy-core process {p.pid} did not start (exit code {p.poll()})")
            time.sleep(0.05)
        except BaseException:
            _stop(self.procs)
            raise
        return self

    def __exit__(self, *exc) -> None:
        _stop(self.procs)
        for p in self.procs:
            if p.stdout:
                p.stdout.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]
