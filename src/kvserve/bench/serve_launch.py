"""`kvserve bench serve`, the run around the load: servers started on a free port, their
memory, one target end to end (start, warm up, load, stop), the report (table, chart) and the
command itself (`serve_command`). The load and its metrics are in `kvserve.bench.serve`, which
imports nothing from here.

- kvserve: `python -m kvserve.server serve` with the default (or given) model.
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
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Self

import httpx
import numpy as np
import typer

from kvserve.bench.common import console, progress, write_outputs
from kvserve.bench.serve import (
    BACKENDS,
    BenchRequest,
    ServeConfig,
    ServeMetrics,
    calculate_metrics,
    fetch_profile,
    parse_goodput,
    profile_delta,
    profile_table,
    run_load,
    sample_requests,
    warmup,
)
from kvserve.errors import InvalidRequest, KVServeError, ModelLoadError

LAUNCHABLE = ("kvserve", "llama-cpp")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
                raise ModelLoadError(f"{self.name} server exited with code {self.proc.returncode}; "
                                     f"its log ({self.log_path}) ends with:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                code = httpx.get(self.base_url + "/health", timeout=2).status_code
                if code == 404:   # llama-cpp-python's server has no /health
                    code = httpx.get(self.base_url + "/v1/models", timeout=2).status_code
                if code == 200:
                    return self
            time.sleep(0.25)
        self.stop()
        raise ModelLoadError(f"{self.name} server not healthy after {timeout_s:.0f}s; log: {self.log_path}")

    def log_tail(self, n: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path else ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)

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
        env = {"OMP_NUM_THREADS": str(threads)}   # torch's intra-op threads in the server
        return LaunchedServer(name, cmd + extra, "kvserve", port, env=env)
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
    try:
        served = server.model_name() if server else None
        asyncio.run(warmup(target.base_url, cfg, target.backend, served, api_key))
        before = fetch_profile(target.base_url, api_key) if profile and target.backend == "kvserve" else None
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
            emit("errors", label=target.label, n=len(errors), first=errors[0])
        return m
    finally:
        if server:
            server.stop()


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


def serve_command(
    base_url: Annotated[list[str] | None, typer.Option(
        "--base-url", help="A running OpenAI-compatible server (repeatable), e.g. http://127.0.0.1:8000.")] = None,
    launch: Annotated[list[str] | None, typer.Option(
        help="Start this server on a free port first: kvserve, llama-cpp (repeatable; run one after another).")] = None,
    backend: str = typer.Option("kvserve", help="Extras --base-url servers understand: kvserve, llama-cpp, openai."),
    model: str = typer.Option(None, help="Model for prompts' tokenizer and launched servers (default: SmolLM2)."),
    endpoint: str = typer.Option("chat", help="chat (/v1/chat/completions) or completions (/v1/completions)."),
    num_prompts: int = typer.Option(64, "--num-prompts", min=1),
    concurrency: int = typer.Option(None, "--concurrency", min=1, help="Most requests in flight (default: no cap)."),
    request_rate: float = typer.Option(math.inf, "--request-rate", help="Requests/s, Poisson arrivals (inf: all at once)."),
    burstiness: float = typer.Option(1.0, help="Gamma shape of arrival gaps (1.0: Poisson)."),
    input_len: int = typer.Option(128, "--input-len", min=1, help="Prompt tokens."),
    output_len: int = typer.Option(128, "--output-len", min=1, help="Output tokens (EOS ignored where supported)."),
    range_ratio: float = typer.Option(0.0, help="Draw lengths uniformly from len*[1-r, 1+r] (0: fixed)."),
    seed: int = typer.Option(0),
    goodput: Annotated[list[str] | None, typer.Option(help="SLOs in ms for goodput: ttft:500 tpot:100 e2el:20000.")] = None,
    threads: int = typer.Option(2, min=1, help="CPU threads for launched servers."),
    api_key: str = typer.Option(None, envvar="OPENAI_API_KEY", help="Bearer key for --base-url servers."),
    out_dir: Annotated[Path, typer.Option(help="Where serve.md, serve.json and serve.png go.")] = Path("runs/bench"),
    profile: bool = typer.Option(False, "--profile", help="Print each kvserve server's time per step phase "
                                 "(schedule, forward, sample, detokenize, HTTP/SSE, ...) during the load."),
    scenario: str = typer.Option("default", help="default, or long-prompt: short probes' TTFT and streams' ITL "
                                 "alone, under load, and while long prompts prefill (bench/scenario.py)."),
    long_len: int = typer.Option(7000, "--long-len", min=1, help="long-prompt scenario: the long prompts' tokens."),
    server_arg: Annotated[list[str] | None, typer.Option(
        "--server-arg", help="Extra argument for a launched kvserve (repeatable): --server-arg=--max-step-ms=100")] = None,
    conversation_writers: int = typer.Option(0, "--conversation-writers", min=0,
                                             help="Loops appending to saved conversations during the load "
                                                  "(kvserve servers)."),
    response_format: str = typer.Option(None, help="A response_format JSON (text or @file) sent with every request."),
    new_schema: bool = typer.Option(False, "--new-schema-per-request", help="Make each json_schema distinct."),
) -> None:
    """Serving benchmark: streaming requests against OpenAI-compatible servers, vLLM's metrics side by side."""
    from kvserve.model.registry import resolve
    from kvserve.tokenizer import Tokenizer

    targets = [Target(label=u, base_url=u, backend=backend) for u in base_url or []]
    targets += [Target(label=name, launch=name) for name in launch or []]
    try:
        if backend not in BACKENDS:
            raise InvalidRequest(f"--backend must be one of {', '.join(BACKENDS)}", param="backend")
        if not targets:
            raise InvalidRequest("give --base-url URL or --launch kvserve / --launch llama-cpp")
        cfg = ServeConfig(num_prompts=num_prompts, concurrency=concurrency, request_rate=request_rate,
                          burstiness=burstiness, input_len=input_len, output_len=output_len,
                          range_ratio=range_ratio, endpoint=endpoint, seed=seed, goodput=parse_goodput(goodput),
                          conversation_writers=conversation_writers,
                          response_format=json.loads(Path(response_format[1:]).read_text() if response_format
                                                     and response_format.startswith("@") else response_format)
                          if response_format else None, new_schema_per_request=new_schema)
        src = resolve(model)
        if src.kind == "gguf":
            from kvserve.model.gguf_loader import open_gguf

            tokenizer = Tokenizer.from_gguf(open_gguf(src.path))
        else:
            tokenizer = Tokenizer.from_dir(src.path)
        if scenario == "long-prompt":
            from kvserve.bench.scenario import long_prompt_command

            return long_prompt_command(targets, tokenizer, cfg, long_len, model, threads, api_key, out_dir,
                                       server_arg, plan_server)
        if scenario != "default":
            raise InvalidRequest(f"--scenario {scenario!r}: choose default or long-prompt", param="scenario")
        requests = sample_requests(tokenizer, cfg)
        results = []
        with progress() as prog:
            tasks: dict[str, int] = {}

            def on_event(kind: str, **info) -> None:
                if kind == "launch":
                    console.print(f"starting {info['label']}: {info['cmd']}" + (f"  [{info['note']}]" if info["note"] else ""))
                elif kind == "start":
                    tasks[info["label"]] = prog.add_task(f"{info['label'][:24]:>24}", total=info["total"])
                elif kind == "advance":
                    prog.advance(tasks[info["label"]], info["n"])
                elif kind == "errors":
                    console.print(f"{info['label']}: {info['n']} requests failed; first: {info['first']}")
                elif kind == "no-profile":
                    console.print(f"{info['label']}: no step profile (--profile reads a kvserve server's /metrics)")

            for t in targets:
                results.append(bench_target(t, requests, cfg, model=model, threads=threads, api_key=api_key,
                                            on_event=on_event, profile=profile,
                                            server_args=server_arg if t.launch == "kvserve" else None))
    except KVServeError as e:
        console.print(f"error: {e.message}")
        raise typer.Exit(1) from None
    table = markdown_table(results)
    rate = "inf" if math.isinf(request_rate) else f"{request_rate:g}/s"
    print(f"{num_prompts} {endpoint} requests, input {input_len} tokens, output {output_len} tokens, "
          f"concurrency {concurrency or 'unlimited'}, rate {rate}, {threads} threads, "
          f"load average {os.getloadavg()[0]:.1f}" + (f", goodput SLOs {cfg.goodput} ms" if cfg.goodput else "") + "\n")
    for m in results:
        if "conversation_writes" in m.extra:
            table += f"\n\n{m.label}: {m.extra['conversation_writes']} conversation appends during the load"
        if "profile" in m.extra:
            table += f"\n\n{m.label} step profile: " + profile_table(m.extra["profile"])
    print(table)
    write_outputs(out_dir, "serve", table, [asdict(m) for m in results])
    save_chart(results, str(out_dir / "serve.png"))
    console.print(f"wrote {out_dir}/serve.md, serve.json, serve.png")

