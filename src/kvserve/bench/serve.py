"""`kvserve bench serve`: an HTTP load generator for any OpenAI-compatible server.

Metrics follow vLLM's serving benchmark (benchmarks/serve.py, backend_request_func.py):
- TTFT: request sent -> first streamed chunk that carries text.
- ITL: the gaps between successive text-carrying chunks, pooled over all requests (a chunk that
  carries several tokens is one gap, as in vLLM).
- TPOT: per request, (E2E latency - TTFT) / (output tokens - 1), for requests with > 1 token.
- E2E latency: request sent -> last text chunk.
- Throughputs divide by the wall time of the whole run; goodput counts only requests meeting
  every SLO given (`ttft:500 tpot:100 e2el:20000`, in ms).
Output tokens come from the server's `usage` (stream_options.include_usage), else one per chunk.

The server under test can be one we start (`launch_server`: kvserve or llama.cpp's server on a
free port), so that one command runs the same load against both; its resident memory is sampled
from /proc during the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import cycle, islice

import httpx
import numpy as np

from kvserve.bench.common import metric_families
from kvserve.errors import InvalidRequest

SLO_KEYS = ("ttft", "tpot", "e2el")
BACKENDS = ("kvserve", "llama-cpp", "openai")


@dataclass
class ServeConfig:
    num_prompts: int = 64
    concurrency: int | None = None        # most requests in flight (None: no cap)
    request_rate: float = math.inf         # requests/s, Poisson arrivals (inf: all at once)
    burstiness: float = 1.0                # gamma shape of the arrival gaps; 1.0 is Poisson
    input_len: int = 128                   # prompt tokens (text from the bundled held-out corpus)
    output_len: int = 128
    range_ratio: float = 0.0               # lengths drawn uniformly from len * [1 - r, 1 + r]
    endpoint: str = "chat"                 # chat | completions
    ignore_eos: bool = True                # ask for exactly output_len tokens
    seed: int = 0
    goodput: dict[str, float] = field(default_factory=dict)   # SLO name -> ms
    timeout_s: float = 1800.0
    conversation_writers: int = 0          # loops appending to saved conversations during the load
    response_format: dict | None = None    # sent with every request (structured output)
    new_schema_per_request: bool = False   # a distinct json_schema each time (compile not cached)
    repeat_ratio: float = 0.0              # this share of the requests (the last ones) repeat earlier prompts

    def __post_init__(self) -> None:
        if self.endpoint not in ("chat", "completions"):
            raise InvalidRequest("endpoint must be chat or completions", param="endpoint")
        if not 0.0 <= self.range_ratio < 1.0:
            raise InvalidRequest("--range-ratio must be in [0, 1)", param="range_ratio")
        if not 0.0 <= self.repeat_ratio < 1.0:
            raise InvalidRequest("--repeat-ratio must be in [0, 1)", param="repeat_ratio")
        if self.request_rate <= 0:
            raise InvalidRequest("--request-rate must be > 0 (inf sends all at once)", param="request_rate")
        for k in self.goodput:
            if k not in SLO_KEYS:
                raise InvalidRequest(f"unknown SLO {k!r}: use ttft, tpot or e2el (ms)", param="goodput")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:100'] -> {'ttft': 500.0, 'tpot': 100.0} (milliseconds)."""
    out: dict[str, float] = {}
    for item in items or []:
        for part in item.replace(",", " ").split():
            name, _, value = part.partition(":")
            try:
                out[name.strip().lower()] = float(value)
            except ValueError:
                raise InvalidRequest(f"--goodput {part!r}: write NAME:MS, e.g. ttft:500 tpot:100",
                                     param="goodput") from None
            if name.strip().lower() not in SLO_KEYS:
                raise InvalidRequest(f"--goodput {part!r}: the SLOs are ttft, tpot and e2el (ms)", param="goodput")
    return out


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int       # tokens of the prompt text under the model's tokenizer (before any template)
    output_len: int
    model: str | None = None    # this request's "model" (a LoRA adapter's name); None: the server's


@dataclass
class RequestResult:
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0        # seconds
    latency: float = 0.0     # seconds, to the last text chunk
    itl: list[float] = field(default_factory=list)
    start: float = 0.0       # perf_counter when sent ...
    times: list[float] = field(default_factory=list)   # ... and of each text chunk
    success: bool = False
    error: str = ""


@dataclass
class ServeMetrics:
    label: str
    completed: int
    failed: int
    duration_s: float
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    ttft_ms: dict[str, float]    # mean, median, p99 (and std)
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2el_ms: dict[str, float]
    max_concurrency: int | None = None
    peak_rss_mb: float | None = None   # sampled during the run
    vm_hwm_mb: float | None = None     # the kernel's high-water mark over the process's life
    extra: dict = field(default_factory=dict)


def _stats(values: list[float]) -> dict[str, float]:
    a = np.asarray(values or [0.0], dtype=np.float64) * 1000.0
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99)),
            "std": float(a.std())}


def calculate_metrics(results: list[RequestResult], duration_s: float, goodput: dict[str, float] | None = None,
                      label: str = "") -> ServeMetrics:
    """vLLM's definitions over finished requests (failed ones count 0 output tokens)."""
    ttfts, tpots, all_tpots, itls, e2els, outs = [], [], [], [], [], []
    total_input = completed = 0
    for r in results:
        if not r.success:
            continue
        completed += 1
        total_input += r.prompt_len
        outs.append(r.output_tokens)
        tpot = 0.0
        if r.output_tokens > 1:
            tpot = (r.latency - r.ttft) / (r.output_tokens - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls += r.itl
        ttfts.append(r.ttft)
        e2els.append(r.latency)
    good = None
    if goodput:
        per_req = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        good = 0
        for i in range(completed):
            if all(per_req[k][i] * 1000.0 <= slo for k, slo in goodput.items()):
                good += 1
    dur = max(duration_s, 1e-9)
    total_output = sum(outs)
    return ServeMetrics(
        label=label, completed=completed, failed=len(results) - completed, duration_s=duration_s,
        total_input=total_input, total_output=total_output, request_throughput=completed / dur,
        request_goodput=None if good is None else good / dur, output_throughput=total_output / dur,
        total_token_throughput=(total_input + total_output) / dur,
        ttft_ms=_stats(ttfts), tpot_ms=_stats(tpots), itl_ms=_stats(itls), e2el_ms=_stats(e2els))


# ---- the workload -------------------------------------------------------------------------------

def sample_requests(tokenizer, cfg: ServeConfig) -> list[BenchRequest]:
    """Prompts of the requested token lengths, cut at seeded random offsets of the held-out corpus
    (different text per request, so no two prompts share a cacheable prefix). With `repeat_ratio`
    the last round(ratio * n) requests repeat the first ones in order, word for word (a workload
    with repeats: the semantic cache's; each repeat is sent after its original)."""
    from kvserve.train.data import load_corpus, split_documents

    text = "\n\n".join(split_documents(load_corpus())[1])
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(cfg.seed)

    def length(n: int) -> int:
        lo, hi = max(1, int(n * (1 - cfg.range_ratio))), max(1, int(n * (1 + cfg.range_ratio)))
        return rng.randint(lo, hi)

    out = []
    for _ in range(cfg.num_prompts):
        n_in, n_out = length(cfg.input_len), length(cfg.output_len)
        if n_in >= len(ids):
            raise InvalidRequest(f"--input-len {n_in} is longer than the corpus ({len(ids)} tokens)",
                                 param="input_len")
        start = rng.randrange(0, len(ids) - n_in)
        # Decoding then re-encoding can merge tokens at the edges; trim until the length fits.
        piece = ids[start:start + n_in]
        prompt = tokenizer.decode(piece)
        while len(tokenizer.encode(prompt, add_special_tokens=False)) > n_in and len(piece) > 1:
            piece = piece[:-1]
            prompt = tokenizer.decode(piece)
        out.append(BenchRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), n_out))
    repeats = round(cfg.repeat_ratio * cfg.num_prompts)
    if repeats:
        first = out[:cfg.num_prompts - repeats]
        out = first + [BenchRequest(r.prompt, r.prompt_len, r.output_len) for r in islice(cycle(first), repeats)]
    return out


def build_payload(req: BenchRequest, cfg: ServeConfig, backend: str, model: str | None) -> dict:
    body: dict = {"stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
                  "max_tokens": req.output_len}
    if req.model or model:
        body["model"] = req.model or model
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if cfg.ignore_eos and backend in ("kvserve", "llama-cpp"):
        body["ignore_eos"] = True
    if backend == "llama-cpp":
        body["n_predict"] = req.output_len   # llama.cpp's own name; it wins over max_tokens
    if cfg.response_format is not None:
        rf = cfg.response_format
        if cfg.new_schema_per_request and rf.get("type") == "json_schema":
            js = rf["json_schema"]
            rf = {**rf, "json_schema": {**js, "schema": {**js["schema"], "title": f"bench-{uuid.uuid4().hex}"}}}
        body["response_format"] = rf
    return body


async def send_request(client: httpx.AsyncClient, url: str, payload: dict, prompt_len: int,
                       chat: bool) -> RequestResult:
    """One streaming request, timed chunk by chunk."""
    res = RequestResult(prompt_len=prompt_len)
    chunks = 0
    usage_out = None
    st = most_recent = res.start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                msg = json.loads(data)
                if msg.get("error"):
                    res.error = str(msg["error"])[:300]
                    return res
                choices = msg.get("choices") or []
                text = ""
                if choices:
                    c = choices[0]
                    text = ((c.get("delta") or {}).get("content") or "") if chat else (c.get("text") or "")
                if text:
                    res.times.append(now)
                    if chunks == 0:
                        res.ttft = now - st
                    else:
                        res.itl.append(now - most_recent)
                    most_recent = now
                    chunks += 1
                usage = msg.get("usage")
                if usage:
                    usage_out = usage.get("completion_tokens")
                    if usage.get("prompt_tokens"):
                        res.prompt_len = int(usage["prompt_tokens"])
        res.output_tokens = int(usage_out) if usage_out else chunks
        res.latency = most_recent - st
        res.success = chunks > 0
        if not res.success:
            res.error = "no text streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n).tolist()


async def run_load(base_url: str, requests: list[BenchRequest], cfg: ServeConfig, backend: str = "kvserve",
                   model: str | None = None, api_key: str | None = None,
                   on_done: Callable[[RequestResult], None] | None = None) -> tuple[list[RequestResult], float]:
    """Send `requests` with the configured arrivals/concurrency; return the results and the wall time."""
    chat = cfg.endpoint == "chat"
    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    sem = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else contextlib.nullcontext()
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=30.0), limits=limits,
                                 headers=headers) as client:
        async def one(req: BenchRequest) -> RequestResult:
            async with sem:
                r = await send_request(client, url, build_payload(req, cfg, backend, model), req.prompt_len, chat)
            if on_done:
                on_done(r)
            return r

        tasks = []
        t0 = time.perf_counter()
        for req, gap in zip(requests, _arrival_gaps(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed),
                            strict=True):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


async def warmup(base_url: str, cfg: ServeConfig, backend: str, model: str | None, api_key: str | None) -> None:
    """One short request first (as vLLM does), so one-time costs stay out of the numbers."""
    short = ServeConfig(endpoint=cfg.endpoint, num_prompts=1, output_len=8, timeout_s=cfg.timeout_s)
    results, _ = await run_load(base_url, [BenchRequest("Hello, how are you?", 6, 8)], short, backend, model,
                                api_key)
    if not results[0].success:
        raise InvalidRequest(f"warm-up request to {base_url} failed: {results[0].error}")


# ---- the server's step profile (kvserve only) -----------------------------------------------------

# /metrics phase -> (where it runs, what it covers); the engine's phases add up to its busy time.
PROFILE_PHASES = {
    "schedule": ("engine", "scheduler.schedule: batch, KV blocks, prefix cache"),
    "prepare": ("engine", "runner: pack ids/positions, attention metadata"),
    "forward": ("engine", "decoder stack, attention included"),
    "logits": ("engine", "lm_head on the sampled rows"),
    "sample": ("engine", "sampler, results as lists"),
    "update": ("engine", "scheduler.update_from_output: append, stops, free"),
    "messages": ("engine", "busy loop: client messages in, outputs out"),
    "output": ("event loop", "client output processing: detokenize, stop strings"),
    "http": ("event loop", "handler: stages, SSE formatting, socket writes"),
}
_PROFILE_COUNTERS = {"kvserve:engine_steps": "steps", "kvserve:batched_tokens": "batched_tokens",
                     "kvserve:batched_requests": "batched_requests"}


def fetch_profile(base_url: str, api_key: str | None = None) -> dict | None:
    """A kvserve server's cumulative step profile from /metrics: {"phases": {phase: seconds},
    "steps", "batched_tokens", "batched_requests"}; None when the server exports none."""
    families = metric_families(base_url, api_key)
    if families is None:
        return None
    out: dict = {"phases": {}}
    for fam in families:
        for s in fam.samples:
            if fam.name == "kvserve:phase_seconds" and s.name.endswith("_total"):
                out["phases"][s.labels["phase"]] = out["phases"].get(s.labels["phase"], 0.0) + s.value
            elif fam.name in _PROFILE_COUNTERS and s.name.endswith("_total"):
                out[_PROFILE_COUNTERS[fam.name]] = out.get(_PROFILE_COUNTERS[fam.name], 0.0) + s.value
    return out if out["phases"] and "steps" in out else None


def profile_delta(before: dict, after: dict, wall_s: float) -> dict:
    """What the run added to the server's profile, with the run's wall time."""
    phases = {k: max(0.0, v - before["phases"].get(k, 0.0)) for k, v in after["phases"].items()}
    d = {k: int(after.get(k, 0) - before.get(k, 0)) for k in _PROFILE_COUNTERS.values()}
    return {"wall_s": wall_s, "phases": phases, **d}


def profile_table(p: dict) -> str:
    """Phase, seconds, share of the run's wall time, ms per engine step; the engine's phases are
    summed (its busy time: the rest of the wall it waited for work), the event loop's phases
    ran at the same time on the server's other thread (or process)."""
    wall, steps = max(p["wall_s"], 1e-9), max(p["steps"], 1)
    phases = p["phases"]
    rows = []

    def row(name: str, where: str, sec: float, note: str = "") -> None:
        rows.append(f"| {name} | {where} | {sec:,.2f} | {100 * sec / wall:.1f}% | {1000 * sec / steps:.2f} | {note} |")

    order = [k for k in PROFILE_PHASES if k in phases] + sorted(k for k in phases if k not in PROFILE_PHASES)
    engine = [k for k in order if PROFILE_PHASES.get(k, ("engine",))[0] == "engine"]
    for k in engine:
        row(k, "engine", phases[k], PROFILE_PHASES.get(k, ("", ""))[1])
    busy = sum(phases[k] for k in engine)
    row("**engine busy**", "engine", busy, "sum of the above")
    row("engine idle", "engine", max(0.0, p["wall_s"] - busy), "waiting for requests")
    for k in order:
        if k not in engine:
            row(k, PROFILE_PHASES[k][0], phases[k], PROFILE_PHASES[k][1])
    head = (f"{p['steps']:,} engine steps, {p['batched_tokens'] / steps:.1f} tokens and "
            f"{p['batched_requests'] / steps:.1f} requests per step, wall {p['wall_s']:.2f} s\n\n"
            "| phase | where | seconds | share of wall | ms per step | covers |\n|---|---|---:|---:|---:|---|")
    return "\n".join([head] + rows)
