"""`kvserve bench serve --scenario batch`: an interactive stream's inter-token latency while a large
Batch API job runs on the same server (issue 50: median ITL within 1.5x of an idle server's, every
line answered exactly once).

  idle    interactive streams (chat, `stream_len` tokens, ignore_eos) one after another on an idle
          server, before the batch and after it: their ITL;
  batch   a batch of `lines` chat requests (`line_tokens` tokens each) uploaded and created with the
          Files and Batch APIs, and the same interactive streams back to back while it is
          in_progress: their ITL; then the batch's output file checked (each custom_id once).

The report gives both phases' median and p99 ITL and TTFT, their ratio, and the batch's wall time,
line rate and counts.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

from kvserve.bench.serve import BenchRequest, RequestResult, ServeConfig, build_payload, send_request

STREAM_PROMPT = "Write a long story about a lighthouse keeper and the ships she watched over the years."


@dataclass
class BatchScenario:
    lines: int = 500
    line_tokens: int = 16
    stream_len: int = 64
    idle_streams: int = 3
    timeout_s: float = 7200.0


@dataclass
class BatchRun:
    idle: list[RequestResult] = field(default_factory=list)
    during: list[RequestResult] = field(default_factory=list)
    batch: dict = field(default_factory=dict)
    wall_s: float = 0.0
    duplicates: int = 0
    missing: int = 0


def _gaps(results: list[RequestResult]) -> list[float]:
    return [b - a for r in results if r.success for a, b in zip(r.times, r.times[1:])]


def _ms(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1000.0, q)) if values else float("nan")


def batch_file(sc: BatchScenario, model: str | None) -> bytes:
    rows = []
    for i in range(sc.lines):
        body = {"messages": [{"role": "user", "content": f"Question {i}: name a colour and a number."}],
                "max_tokens": sc.line_tokens, "temperature": 0.0}
        if model:
            body["model"] = model
        rows.append(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")
    return "".join(rows).encode()


async def run_batch_scenario(base_url: str, sc: BatchScenario, model: str | None = None,
                             api_key: str | None = None) -> BatchRun:
    cfg = ServeConfig(endpoint="chat", ignore_eos=True, timeout_s=3600)
    base = base_url.rstrip("/")
    url = base + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    stream = build_payload(BenchRequest(STREAM_PROMPT, 20, sc.stream_len), cfg, "kvserve", model)
    out = BatchRun()
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=30.0), headers=headers) as client:
        await send_request(client, url, stream, 20, True)     # warm-up
        for _ in range(sc.idle_streams):
            out.idle.append(await send_request(client, url, stream, 20, True))
        up = await client.post(base + "/v1/files", data={"purpose": "batch"},
                               files={"file": ("bench.jsonl", batch_file(sc, model), "application/jsonl")})
        up.raise_for_status()
        t0 = time.perf_counter()
        created = await client.post(base + "/v1/batches", json={"input_file_id": up.json()["id"],
                                                                 "endpoint": "/v1/chat/completions",
                                                                 "completion_window": "24h"})
        created.raise_for_status()
        batch_id = created.json()["id"]
        while True:
            batch = (await client.get(f"{base}/v1/batches/{batch_id}")).json()
            if batch["status"] in ("completed", "failed", "cancelled", "expired") \
                    or time.perf_counter() - t0 > sc.timeout_s:
                break
            if batch["status"] == "in_progress" and batch["request_counts"]["completed"] < sc.lines * 0.9:
                out.during.append(await send_request(client, url, stream, 20, True))
            else:
                await asyncio.sleep(0.5)
        out.wall_s = time.perf_counter() - t0
        out.batch = batch
        for _ in range(sc.idle_streams):     # idle again: the machine's load may have moved meanwhile
            out.idle.append(await send_request(client, url, stream, 20, True))
        if batch.get("output_file_id"):
            text = (await client.get(f"{base}/v1/files/{batch['output_file_id']}/content")).text
            ids = [json.loads(x)["custom_id"] for x in text.splitlines()]
            out.duplicates = len(ids) - len(set(ids))
            out.missing = sc.lines - len(set(ids))
    return out


def batch_table(label: str, sc: BatchScenario, run: BatchRun) -> str:
    idle, during = _gaps(run.idle), _gaps(run.during)
    rows = ["| phase | streams | ITL median (ms) | ITL p99 (ms) | TTFT median (ms) | median ITL vs idle |",
            "|---|---:|---:|---:|---:|---:|"]
    for name, results, gaps in (("idle", run.idle, idle), ("batch running", run.during, during)):
        ttft = [r.ttft for r in results if r.success]
        rows.append(f"| {name} | {len(ttft)} | {_ms(gaps, 50):,.1f} | {_ms(gaps, 99):,.1f} | {_ms(ttft, 50):,.1f} | "
                    f"{_ms(gaps, 50) / _ms(idle, 50):.2f}x |")
    counts = run.batch.get("request_counts", {})
    foot = (f"\n\n{label}: batch of {sc.lines} chat lines x {sc.line_tokens} tokens: {run.batch.get('status')} in "
            f"{run.wall_s:,.1f} s ({counts.get('completed', 0) / max(run.wall_s, 1e-9):.2f} lines/s), "
            f"completed {counts.get('completed')}, failed {counts.get('failed')}, "
            f"duplicate answers {run.duplicates}, missing {run.missing}")
    return "\n".join(rows) + foot


def batch_command(targets: list, model: str | None, threads: int, api_key: str | None, out_dir, server_args,
                  plan_server, sc: BatchScenario | None = None) -> None:
    """Each target in turn (a --base-url, or --launch kvserve), one table each."""
    import os

    from kvserve.bench.common import write_outputs

    sc = sc or BatchScenario()
    tables, data = [], []
    for t in targets:
        server = None
        if t.launch:
            server = plan_server(t.launch, model, threads, 8, 2048, server_args)
            print(f"starting {' '.join(server.cmd)}")
            server.start()
            t.base_url = server.base_url
        keep_log = True
        try:
            run = asyncio.run(run_batch_scenario(t.base_url, sc, server.model_name() if server else None, api_key))
            keep_log = False
        finally:
            if server:
                server.stop(keep_log=keep_log)
        tables.append(f"### {t.label}\n\n{batch_table(t.label, sc, run)}")
        data.append({"label": t.label, "config": asdict(sc), "idle_itl_s": _gaps(run.idle),
                     "batch_itl_s": _gaps(run.during), "batch": run.batch, "wall_s": run.wall_s,
                     "duplicates": run.duplicates, "missing": run.missing})
    table = "\n\n".join(tables)
    print(f"batch scenario: {sc.lines} lines, streams of {sc.stream_len} tokens, load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print(table)
    write_outputs(out_dir, "serve-batch", table, data)
