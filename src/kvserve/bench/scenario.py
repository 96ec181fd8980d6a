"""`kvserve bench serve --scenario long-prompt`: what a long prompt does to everyone else.

Three phases against one server, each measured on the same short requests:

  alone     short probe requests, one at a time, nothing else running: their TTFT alone;
  streams   N streaming requests decoding back to back, probes sent every interval: the streams'
            ITL and the probes' TTFT with ordinary load (the unloaded baseline);
  long      the same, plus long prompts (LONG_LEN tokens, one at a time) prefilling: the streams'
            ITL and the probes' TTFT while a long prompt is in progress, and the long prompts'
            own time to first token.

The report puts each phase's median and p99 side by side with the ratio to the baseline (issue 24's
targets: probe TTFT during a long prefill <= 2x alone plus one step, stream p99 ITL <= 2x unloaded).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from kvserve.bench.serve import BenchRequest, RequestResult, ServeConfig, build_payload, send_request


@dataclass
class LongPromptConfig:
    long_len: int = 7000
    num_long: int = 2                # long prompts, sent one after another in the long phase
    num_streams: int = 4
    stream_output_len: int = 64
    probe_output_len: int = 8
    probe_interval_s: float = 1.0
    phase_s: float = 10.0            # length of the streams-only phase
    num_alone: int = 5


@dataclass
class PhaseResult:
    probes: list[RequestResult] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)      # stream gaps that ended inside the window
    longs: list[RequestResult] = field(default_factory=list)


def _ms(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1000.0, q)) if values else float("nan")


async def _streams(client, url: str, reqs: list[BenchRequest], cfg: ServeConfig, sc: LongPromptConfig,
                   stop: asyncio.Event, backend: str, model: str | None, out: list[RequestResult]) -> None:
    async def one(i: int) -> None:
        k = i
        while not stop.is_set():
            r = reqs[k % len(reqs)]
            req = BenchRequest(r.prompt, r.prompt_len, sc.stream_output_len)
            out.append(await send_request(client, url, build_payload(req, cfg, backend, model), r.prompt_len, True))
            k += sc.num_streams
    await asyncio.gather(*(one(i) for i in range(sc.num_streams)))


async def _probes(client, url: str, probes: list[BenchRequest], cfg: ServeConfig, sc: LongPromptConfig,
                  stop: asyncio.Event, backend: str, model: str | None, out: list[RequestResult]) -> None:
    k = 0
    while not stop.is_set():
        p = probes[k % len(probes)]
        req = BenchRequest(p.prompt, p.prompt_len, sc.probe_output_len)
        t = time.perf_counter()
        out.append(await send_request(client, url, build_payload(req, cfg, backend, model), p.prompt_len, True))
        k += 1
        await asyncio.sleep(max(0.0, sc.probe_interval_s - (time.perf_counter() - t)))


def _gaps_within(streams: list[RequestResult], t0: float, t1: float) -> list[float]:
    gaps = []
    for r in streams:
        for a, b in zip(r.times, r.times[1:]):
            if t0 <= b <= t1:
                gaps.append(b - a)
    return gaps


async def run_long_prompt(base_url: str, streams: list[BenchRequest], probes: list[BenchRequest],
                          longs: list[BenchRequest], sc: LongPromptConfig, backend: str = "kvserve",
                          model: str | None = None, api_key: str | None = None) -> dict[str, PhaseResult]:
    cfg = ServeConfig(endpoint="chat", ignore_eos=True, timeout_s=3600)
    url = base_url.rstrip("/") + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    phases = {name: PhaseResult() for name in ("alone", "streams", "long")}
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=30.0), headers=headers,
                                 limits=httpx.Limits(max_connections=None)) as client:
        for p in probes[: sc.num_alone]:
            req = BenchRequest(p.prompt, p.prompt_len, sc.probe_output_len)
            phases["alone"].probes.append(await send_request(client, url, build_payload(req, cfg, backend, model),
                                                             p.prompt_len, True))
            await asyncio.sleep(0.2)
        for name in ("streams", "long"):
            ph, stop, stream_results = phases[name], asyncio.Event(), []
            s_task = asyncio.create_task(_streams(client, url, streams, cfg, sc, stop, backend, model,
                                                  stream_results))
            await asyncio.sleep(2.0)                     # the streams are decoding
            t0 = time.perf_counter()
            p_task = asyncio.create_task(_probes(client, url, probes, cfg, sc, stop, backend, model, ph.probes))
            if name == "streams":
                await asyncio.sleep(sc.phase_s)
            else:
                for lg in longs:
                    req = BenchRequest(lg.prompt, lg.prompt_len, 1)
                    ph.longs.append(await send_request(client, url, build_payload(req, cfg, backend, model),
                                                       lg.prompt_len, True))
            t1 = time.perf_counter()
            stop.set()
            await asyncio.gather(s_task, p_task)
            ph.itl = _gaps_within(stream_results, t0, t1)
            ph.probes = [r for r in ph.probes if r.success and r.start <= t1]
    return phases


def long_prompt_table(label: str, phases: dict[str, PhaseResult]) -> str:
    alone = [r.ttft for r in phases["alone"].probes if r.success]
    base_ttft = _ms(alone, 50)
    base_itl = _ms(phases["streams"].itl, 99)
    head = ("| phase | probe TTFT median (ms) | probe TTFT p99 (ms) | probes | stream ITL median (ms) | "
            "stream ITL p99 (ms) | p99 ITL vs streams phase |")
    rows = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    for name, ph in phases.items():
        ttft = [r.ttft for r in ph.probes if r.success]
        rows.append(f"| {name} | {_ms(ttft, 50):,.1f} | {_ms(ttft, 99):,.1f} | {len(ttft)} | "
                    f"{_ms(ph.itl, 50):,.1f} | {_ms(ph.itl, 99):,.1f} | "
                    f"{_ms(ph.itl, 99) / base_itl:.2f}x |" if ph.itl else
                    f"| {name} | {_ms(ttft, 50):,.1f} | {_ms(ttft, 99):,.1f} | {len(ttft)} | - | - | - |")
    during = [r.ttft for r in phases["long"].probes if r.success]
    longs = phases["long"].longs
    foot = (f"\n\n{label}: probe TTFT while long prompts prefill, median {_ms(during, 50) / base_ttft:.2f}x and "
            f"p99 {_ms(during, 99) / base_ttft:.2f}x its median alone; long prompts "
            + ", ".join(f"{r.prompt_len} tokens: TTFT {r.ttft:.2f} s" + ("" if r.success else f" (failed: {r.error})")
                        for r in longs))
    return "\n".join(rows) + foot


def bench_long_prompt(target, tokenizer, cfg: ServeConfig, sc: LongPromptConfig, *, model: str | None = None,
                      threads: int = 2, api_key: str | None = None, on_event=None,
                      server_args: list[str] | None = None, plan_server=None) -> tuple[str, dict]:
    """Start the target's server if asked (`plan_server`: bench.serve_launch's), run the scenario,
    stop it: (markdown, numbers)."""
    from dataclasses import asdict, replace

    from kvserve.bench.serve import sample_requests, warmup

    emit = on_event or (lambda kind, **info: None)
    streams = sample_requests(tokenizer, replace(cfg, num_prompts=max(8, sc.num_streams)))
    probes = sample_requests(tokenizer, replace(cfg, num_prompts=16, seed=cfg.seed + 1))
    longs = sample_requests(tokenizer, replace(cfg, num_prompts=sc.num_long, input_len=sc.long_len, output_len=1,
                                               range_ratio=0.0, seed=cfg.seed + 2))
    server = None
    if target.launch:
        ctx = sc.long_len + 256
        server = plan_server(target.launch, model, threads, sc.num_streams + sc.num_long + 1, ctx, server_args)
        emit("launch", label=target.label, cmd=" ".join(server.cmd), note=server.note)
        server.start()
        target.base_url, target.backend = server.base_url, server.backend
    keep_log = True
    try:
        served = server.model_name() if server else None
        asyncio.run(warmup(target.base_url, cfg, target.backend, served, api_key))
        phases = asyncio.run(run_long_prompt(target.base_url, streams, probes, longs, sc, target.backend, served,
                                             api_key))
        keep_log = False
    finally:
        if server:
            server.stop(keep_log=keep_log)
    data = {name: {"probe_ttft_s": [r.ttft for r in ph.probes], "itl_s": ph.itl,
                   "long": [{"prompt_len": r.prompt_len, "ttft_s": r.ttft, "error": r.error} for r in ph.longs]}
            for name, ph in phases.items()}
    return long_prompt_table(target.label, phases), {"label": target.label, "config": asdict(sc), **data}


def long_prompt_command(targets: list, tokenizer, cfg: ServeConfig, long_len: int, model: str | None,
                        threads: int, api_key: str | None, out_dir: Path, server_args: list[str] | None,
                        plan_server) -> None:
    """`kvserve bench serve --scenario long-prompt`: each target in turn, one table each."""
    import os

    from kvserve.bench.common import console, write_outputs

    sc = LongPromptConfig(long_len=long_len)
    tables, data = [], []
    for t in targets:
        md, d = bench_long_prompt(t, tokenizer, cfg, sc, model=model, threads=threads, api_key=api_key,
                                  server_args=server_args if t.launch == "kvserve" else None, plan_server=plan_server,
                                  on_event=lambda kind, **i: kind == "launch" and console.print(f"starting {i['cmd']}"))
        tables.append(f"### {t.label}\n\n{md}")
        data.append(d)
    table = "\n\n".join(tables)
    print(f"long-prompt scenario: {sc.num_streams} streams, probes of {cfg.input_len} tokens every "
          f"{sc.probe_interval_s:g} s, {sc.num_long} long prompts of {long_len} tokens, {threads} threads, "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print(table)
    write_outputs(out_dir, "serve-long-prompt", table, data)
