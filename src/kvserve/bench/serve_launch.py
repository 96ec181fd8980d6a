"""`kvserve bench serve`, the run around the load: servers started on a free port, their
memory, one target end to end (start, warm up, load, stop) and the report (table, chart). The
command itself is `kvserve.bench.serve_cli`; the load and its metrics are in `kvserve.bench.serve`,
which imports nothing from here.

- kvserve: `python -m kvserve.server serve` with the default (or given) model, the semantic
  cache and moderation off unless `--server-arg` says otherwise (the peers have neither, and
  the benches' random-token prompts are not text a moderation classifier can judge).
- llama-cpp: llama.cpp's own HTTP server (`llama-server`, the C++ one, with parallel slots and
  continuous batching) when a binary is found ($LLAMA_SERVER, PATH, or runs/llama.cpp/build/bin);
  otherwise llama-cpp-python's `python -m llama_cpp.server`, which serves one request at a time
  (a warning says so). Both load the same GGUF file with the same thread count.

Resident memory is read from /proc/PID/status: VmRSS sampled every 100 ms while the load runs
(the peak is reported) and VmHWM, the kernel's high-water mark since the process started.

With `--profile`, a kvserve target's step profile (/metrics `kvserve:phase_seconds_total` and
the step counters, `serve.fetch_profile`) is read after the warm-up and after the load, and the
difference is printed per phase (`serve.profile_table`) and kept in serve.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx
import numpy as np

from kvserve.bench.pools import fetch_pools, pools_delta
from kvserve.bench.serve import (
    BenchRequest,
    ServeConfig,
    ServeMetrics,
    calculate_metrics,
    fetch_profile,
    profile_delta,
    run_load,
    warmup,
)
from kvserve.errors import InvalidRequest, ModelLoadError

LAUNCHABLE = ("kvserve", "llama-cpp")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout: float = 20) -> None:
    """Stop a server process: SIGTERM, then SIGKILL if it has not exited within `timeout`."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def find_llama_server() -> str | None:
    """The llama.cpp server binary: $LLAMA_SERVER, `llama-server` on PATH, or a local build."""
    for cand in (os.environ.get("LLAMA_SERVER"), shutil.which("llama-server"),
                 "runs/llama.cpp/build/bin/llama-server"):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return str(Path(cand).resolve())
    return None


def _proc_status_kb(pid: int, key: str) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


class MemorySampler:
    """Samples a process's VmRSS in a thread; `peak_mb` is the largest seen."""

    def __init__(self, pid: int, interval_s: float = 0.1):
        self.pid, self.interval_s = pid, interval_s
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            kb = _proc_status_kb(self.pid, "VmRSS")
            if kb:
                self.peak_kb = max(self.peak_kb, kb)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    @property
    def peak_mb(self) -> float:
        return self.peak_kb / 1024.0

    def hwm_mb(self) -> float | None:
        kb = _proc_status_kb(self.pid, "VmHWM")
        return None if kb is None else kb / 1024.0


@dataclass
class LaunchedServer:
    name: str
    cmd: list[str]
    backend: str                 # which request extras it understands (see serve.build_payload)
    port: int
    note: str = ""
    env: dict[str, str] = field(default_factory=dict)
    data_dir: str | None = None   # a temp dir of ours (kvserve's --data-dir), removed by stop()
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout_s: float = 600.0) -> LaunchedServer:
        fd, log = tempfile.mkstemp(prefix=f"kvserve-bench-{self.name}-", suffix=".log")
        self.log_path = Path(log)
        with os.fdopen(fd, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **self.env})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.stop(keep_log=True)
                raise ModelLoadError(f"{self.name} server exited with code {self.proc.returncode}; "
                                     f"its log ({self.log_path}) ends with:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                code = httpx.get(self.base_url + "/health", timeout=2).status_code
                if code == 404:   # llama-cpp-python's server has no /health
                    code = httpx.get(self.base_url + "/v1/models", timeout=2).status_code
                if code == 200:
                    return self
            time.sleep(0.25)
        self.stop(keep_log=True)
        raise ModelLoadError(f"{self.name} server not healthy after {timeout_s:.0f}s; log: {self.log_path}")

    def log_tail(self, n: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path else ""

    def stop(self, keep_log: bool = False) -> None:
        """Stop the server and remove what it left in the temp dir: its data dir, and its log
        unless `keep_log` (a run that failed; the error names the log's path)."""
        if self.proc:
            stop_process(self.proc)
        if self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        if self.log_path and not keep_log:
            self.log_path.unlink(missing_ok=True)

    def model_name(self) -> str | None:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
            return httpx.get(self.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        return None


def plan_server(name: str, model: str | None, threads: int, concurrency: int, ctx_per_request: int,
                extra_args: list[str] | None = None) -> LaunchedServer:
    """The command that starts `name` with the same GGUF, threads and request slots."""
    from kvserve.model.registry import resolve

    port = free_port()
    extra = list(extra_args or [])
    if name == "kvserve":
        data_dir = tempfile.mkdtemp(prefix="kvserve-bench-data-")
        cmd = [sys.executable, "-m", "kvserve.server", "serve", "--port", str(port), "--data-dir", data_dir,
               "--max-running", str(max(32, concurrency)), "--max-waiting", str(max(128, 4 * concurrency))]
        if model:
            cmd += ["--model", model]
        if "--semantic-cache" not in extra:   # measure the engine, not answers replayed from the cache
            cmd += ["--semantic-cache", "off"]
        if not any(a.startswith("--moderation") for a in extra):   # the peers do not moderate, and the
            cmd += ["--moderation", "off"]   # benches' random-token prompts are not text a classifier can judge
        env = {"OMP_NUM_THREADS": str(threads)}   # torch's intra-op threads in the server
        return LaunchedServer(name, cmd + extra, "kvserve", port, env=env, data_dir=data_dir)
    if name != "llama-cpp":
        raise InvalidRequest(f"--launch {name!r}: choose from {', '.join(LAUNCHABLE)} "
                             "(or give --base-url for a server you started)", param="launch")
    src = resolve(model)
    if src.kind != "gguf":
        raise InvalidRequest("--launch llama-cpp needs a GGUF model", param="model")
    slots = max(1, concurrency)
    binary = find_llama_server()
    if binary:
        # Recent llama.cpp shares one KV cache between slots; -c is the total, so size it for all.
        cmd = [binary, "-m", str(src.path), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
               "-tb", str(threads), "-np", str(slots), "-cb", "-c", str(slots * ctx_per_request),
               "--no-webui", "--alias", src.name]
        return LaunchedServer(name, cmd + extra, "llama-cpp", port, note=f"llama-server, {slots} slots")
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        raise InvalidRequest("--launch llama-cpp needs llama.cpp's server: build `llama-server` and set "
                             "$LLAMA_SERVER, or `pip install 'llama-cpp-python[server]'`", param="launch") from None
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(src.path), "--host", "127.0.0.1",
           "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads),
           "--n_ctx", str(ctx_per_request), "--model_alias", src.name]
    return LaunchedServer(name, cmd + extra, "llama-cpp", port,
                          note="llama-cpp-python server: one request at a time, ignores ignore_eos "
                               "(no llama-server binary found)")


# ---- one target end to end, and the report ---------------------------------------------------------

@dataclass
class Target:
    label: str
    base_url: str | None = None      # an already-running server ...
    launch: str | None = None        # ... or one we start: kvserve | llama-cpp
    backend: str = "kvserve"


def bench_target(target: Target, requests: list[BenchRequest], cfg: ServeConfig, *, model: str | None = None,
                 threads: int = 2, api_key: str | None = None, on_event: Callable[..., None] | None = None,
                 server_args: list[str] | None = None, profile: bool = False) -> ServeMetrics:
    """Start the server if asked, warm it up, run the load, sample its memory (and with `profile`
    its step profile), stop it."""
    emit = on_event or (lambda kind, **info: None)
    server = None
    if target.launch:
        ctx = max(r.prompt_len for r in requests) + max(r.output_len for r in requests) + 64
        server = plan_server(target.launch, model, threads, cfg.concurrency or len(requests), ctx, server_args)
        emit("launch", label=target.label, cmd=" ".join(server.cmd), note=server.note)
        server.start()
        target.base_url, target.backend = server.base_url, server.backend
    assert target.base_url
    keep_log = True   # until the run ends without failed requests
    try:
        served = server.model_name() if server else None
        asyncio.run(warmup(target.base_url, cfg, target.backend, served, api_key))
        before = fetch_profile(target.base_url, api_key) if profile and target.backend == "kvserve" else None
        pools_before = fetch_pools(target.base_url, api_key) if target.backend == "kvserve" else None
        emit("start", label=target.label, total=len(requests))
        sampler = MemorySampler(server.pid) if server else contextlib.nullcontext()
        with sampler:
            load = run_load(target.base_url, requests, cfg, target.backend, served, api_key,
                            on_done=lambda r: emit("advance", label=target.label, n=1))
            writes = None
            if cfg.conversation_writers and target.backend == "kvserve":
                from kvserve.bench.writers import with_writers

                (results, duration), writes = asyncio.run(with_writers(load, target.base_url, api_key,
                                                                       cfg.conversation_writers))
            else:
                results, duration = asyncio.run(load)
        m = calculate_metrics(results, duration, cfg.goodput, label=target.label)
        m.max_concurrency = cfg.concurrency
        if writes is not None:
            m.extra["conversation_writes"] = writes
        if pools_before is not None:       # a disaggregated server: TTFT and ITL per pool
            m.extra["pools"] = pools_delta(pools_before, fetch_pools(target.base_url, api_key) or {})
        if profile:
            after = fetch_profile(target.base_url, api_key) if before is not None else None
            if after is not None:
                m.extra["profile"] = profile_delta(before, after, duration)
            else:
                emit("no-profile", label=target.label)
        if server:
            m.peak_rss_mb, m.vm_hwm_mb = sampler.peak_mb, sampler.hwm_mb()
            m.extra["server"] = server.note or server.name
        errors = [r.error for r in results if not r.success]
        if errors:
            m.extra["first_error"] = errors[0]
            log = str(server.log_path) if server else None
            if log:
                m.extra["server_log"] = log
            emit("errors", label=target.label, n=len(errors), first=errors[0], log=log)
        keep_log = bool(errors)
        return m
    finally:
        if server:
            server.stop(keep_log=keep_log)


def _f(v: float | None, nd: int = 1) -> str:
    return "-" if v is None else f"{v:,.{nd}f}"


def markdown_table(results: list[ServeMetrics]) -> str:
    """vLLM's result block, one column per server."""
    rows: list[tuple[str, list[str]]] = [
        ("Successful requests", [str(m.completed) for m in results]),
        ("Failed requests", [str(m.failed) for m in results]),
        ("Benchmark duration (s)", [_f(m.duration_s, 2) for m in results]),
        ("Total input tokens", [str(m.total_input) for m in results]),
        ("Total generated tokens", [str(m.total_output) for m in results]),
        ("Request throughput (req/s)", [_f(m.request_throughput, 3) for m in results]),
        ("Request goodput (req/s)", [_f(m.request_goodput, 3) for m in results]),
        ("**Output token throughput (tok/s)**", [f"**{_f(m.output_throughput)}**" for m in results]),
        ("Total token throughput (tok/s)", [_f(m.total_token_throughput) for m in results]),
    ]
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E latency", "e2el_ms")):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {name} (ms)", [_f(getattr(m, key)[stat]) for m in results]))
    rows += [("Peak RSS during run (MB)", [_f(m.peak_rss_mb, 0) for m in results]),
             ("VmHWM, process lifetime (MB)", [_f(m.vm_hwm_mb, 0) for m in results])]
    head = "| metric | " + " | ".join(m.label for m in results) + " |"
    sep = "|---|" + "---:|" * len(results)
    return "\n".join([head, sep] + [f"| {k} | " + " | ".join(v) + " |" for k, v in rows])


def save_chart(results: list[ServeMetrics], path: str) -> None:
    """Four panels: output tok/s, TTFT median/p99, TPOT median/p99, peak RSS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [m.label for m in results]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
    axes[0].bar(labels, [m.output_throughput for m in results], color="tab:blue")
    axes[0].set_title("output tokens/s (higher is better)")
    x = np.arange(len(results))
    for ax, key, title in ((axes[1], "ttft_ms", "TTFT ms"), (axes[2], "tpot_ms", "TPOT ms")):
        ax.bar(x - 0.2, [getattr(m, key)["median"] for m in results], 0.4, label="median")
        ax.bar(x + 0.2, [getattr(m, key)["p99"] for m in results], 0.4, label="p99")
        ax.set_xticks(x, labels)
        ax.set_title(f"{title} (lower is better)")
        ax.legend(fontsize=8)
    axes[3].bar(labels, [m.peak_rss_mb or 0 for m in results], color="tab:gray")
    axes[3].set_title("peak resident memory MB")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
