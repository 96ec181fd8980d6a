"""`kvserve bench serve --scenario multi-turn`: chat conversations that come back after their prefix
was evicted from the KV pool, and after a server restart (issue 51: what the disk tier,
`--kv-offload-dir`, buys over RAM only).

N conversations each open with a document of their own as the system message (`system_len` tokens
of the held-out corpus, as the other scenarios' prompts) and take `turns` turns in rounds: a round
visits every conversation once, in a shuffled order, and each turn re-sends the whole history (the
document, the earlier questions and the answers the server gave) plus a new question, as chat
clients do. A launched kvserve gets a KV pool of about POOL_SHARE of all the conversations' tokens
(unless `--server-arg=--kv-cache-memory=...` says otherwise), so a conversation's prefix has
usually been evicted by the time it comes back. Then the server is stopped and started again on
the same data directory (and disk tier), and every conversation comes back once more.

Per phase (first turns: nothing to hit; returns: turns 2 and later; after restart), from each
response's `usage.prompt_tokens_details.cached_tokens`: the prefix-hit rate (cached prompt tokens /
prompt tokens) and TTFT median and p90; from kvserve's /metrics, the blocks read from the disk tier.
With `--kv-tiers ram,disk` (the default) a launched kvserve runs the whole scenario twice, RAM only
and with `--kv-offload-dir` in a temp dir, printed side by side; a `--base-url` server runs it once,
without the restart.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace

import httpx
import numpy as np

from kvserve.bench.common import console, metric_families, write_outputs
from kvserve.bench.serve import BenchRequest, ServeConfig, build_payload, sample_requests, warmup
from kvserve.bench.serve_launch import Target
from kvserve.errors import InvalidRequest

POOL_SHARE = 0.3          # a launched server's KV pool: this share of all the conversations' tokens
TEMPLATE_TOKENS = 8       # the chat template's tokens around one message (an estimate, for the pool)
PHASES = ("first turns", "returns", "after restart")
TIERS = {"ram": "RAM only", "disk": "disk tier"}


@dataclass
class MultiTurnConfig:
    conversations: int = 8
    turns: int = 3                 # per conversation, before the restart
    system_len: int = 1500         # tokens of each conversation's document
    user_len: int = 48             # tokens of each question
    output_len: int = 32           # tokens of each answer (EOS ignored)
    concurrency: int = 1           # turns in flight (of different conversations)
    seed: int = 0
    timeout_s: float = 3600.0


@dataclass
class Conversation:
    system: str
    system_len: int
    questions: list[str]           # one per turn, the restart's last
    messages: list[dict] = field(default_factory=list)   # the history sent so far (one run's)


@dataclass
class Turn:
    conversation: int
    turn: int
    phase: str
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int | None = None      # None: the server's usage does not say
    answer: str = ""
    error: str = ""


def conversations(tokenizer, mt: MultiTurnConfig) -> list[Conversation]:
    """The documents and questions, cut from the held-out corpus at seeded offsets."""
    docs = sample_requests(tokenizer, ServeConfig(num_prompts=mt.conversations, input_len=mt.system_len,
                                                  seed=mt.seed))
    qs = sample_requests(tokenizer, ServeConfig(num_prompts=mt.conversations * (mt.turns + 1),
                                                input_len=mt.user_len, seed=mt.seed + 1))
    n = mt.turns + 1
    return [Conversation(d.prompt, d.prompt_len, [q.prompt for q in qs[i * n:(i + 1) * n]])
            for i, d in enumerate(docs)]


def _arg(args: list[str], name: str) -> str | None:
    """The value of `name` among server arguments (`--name=value` or `--name value`)."""
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(args):
            return args[i + 1]
    return None


def kv_bytes_per_token(model: str | None, kv_dtype: str) -> int:
    """KV bytes one token takes in `model`'s pool (read from the model's config, no weights)."""
    from kvserve.engine.config import EngineConfig
    from kvserve.model.kv_quant import bytes_per_token
    from kvserve.model.registry import resolve

    src = resolve(model)
    if src.kind == "gguf":
        from kvserve.model.gguf_loader import config_from_gguf, open_gguf

        cfg = config_from_gguf(open_gguf(src.path), src.name)
    else:
        from kvserve.model.hf_loader import config_from_dir

        cfg = config_from_dir(src.path)
    return bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                           EngineConfig(kv_cache_dtype=kv_dtype).torch_kv_dtype)


def final_lengths(convs: list[Conversation], mt: MultiTurnConfig) -> list[int]:
    """Each conversation's last prompt plus its answer, in tokens (estimated)."""
    per_turn = mt.user_len + mt.output_len + 2 * TEMPLATE_TOKENS
    return [c.system_len + TEMPLATE_TOKENS + (mt.turns + 1) * per_turn for c in convs]


def pool_args(model: str | None, server_args: list[str], convs: list[Conversation],
              mt: MultiTurnConfig) -> tuple[list[str], str]:
    """(--kv-cache-memory for a launched kvserve, the pool's description)."""
    given = _arg(server_args, "--kv-cache-memory")
    if given is not None:
        return [], f"KV pool {given} (given)"
    finals = final_lengths(convs, mt)
    tokens = max(int(POOL_SHARE * sum(finals)), (mt.concurrency + 1) * max(finals))
    blocks = -(-tokens // 16)
    size = blocks * 16 * kv_bytes_per_token(model, _arg(server_args, "--kv-cache-dtype") or "fp16")
    return [f"--kv-cache-memory={size}"], (f"KV pool {size / 2**20:,.1f} MiB: {blocks * 16:,} tokens, "
                                           f"{100 * blocks * 16 / sum(finals):.0f}% of the conversations' "
                                           f"{sum(finals):,}")


async def _turn(client: httpx.AsyncClient, url: str, body: dict, out: Turn) -> None:
    """One streamed chat turn: its TTFT, answer and usage into `out`."""
    parts: list[str] = []
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                msg = json.loads(line[5:])
                if msg.get("error"):
                    out.error = str(msg["error"])[:300]
                    return
                text = ((msg.get("choices") or [{}])[0].get("delta") or {}).get("content") or ""
                if text:
                    if not parts:
                        out.ttft_s = time.perf_counter() - t0
                    parts.append(text)
                if usage := msg.get("usage"):
                    out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        out.cached_tokens = int(details["cached_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return
    out.answer = "".join(parts)
    if not out.answer:
        out.error = "no text streamed"


async def run_round(base_url: str, convs: list[Conversation], turn: int, phase: str, mt: MultiTurnConfig,
                    order: list[int], backend: str = "kvserve", model: str | None = None,
                    api_key: str | None = None) -> list[Turn]:
    """Turn `turn` of every conversation, in `order`, at most `mt.concurrency` at once; each
    conversation's history grows by the question and the answer."""
    cfg = ServeConfig(endpoint="chat", ignore_eos=True, timeout_s=mt.timeout_s)
    url = base_url.rstrip("/") + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(mt.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(mt.timeout_s, connect=30.0), headers=headers,
                                 limits=httpx.Limits(max_connections=None)) as client:
        async def one(i: int) -> Turn:
            c = convs[i]
            if not c.messages:
                c.messages = [{"role": "system", "content": c.system}]
            c.messages.append({"role": "user", "content": c.questions[turn]})
            body = build_payload(BenchRequest("", 0, mt.output_len), cfg, backend, model)
            body["messages"] = list(c.messages)
            t = Turn(i, turn, phase)
            async with sem:
                await _turn(client, url, body, t)
            c.messages.append({"role": "assistant", "content": t.answer or "(no answer)"})
            return t

        return list(await asyncio.gather(*(one(i) for i in order)))


def _disk_blocks_read(base_url: str, api_key: str | None) -> float | None:
    """kvserve's `kv_offload_hit_blocks` counter (None: no such metric)."""
    for fam in metric_families(base_url, api_key) or []:
        if fam.name == "kvserve:kv_offload_hit_blocks":
            return sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return None


def run_scenario(target, convs: list[Conversation], mt: MultiTurnConfig, *, model: str | None, threads: int,
                 api_key: str | None, server_args: list[str] | None, plan_server, emit=None) -> dict:
    """The whole scenario on one target (a launched server is restarted once on its own data dir):
    {"turns": [Turn...], "disk_blocks": {phase: n}}."""
    emit = emit or (lambda kind, **info: None)
    convs = [replace(c, messages=[]) for c in convs]
    rng = random.Random(mt.seed)
    server, data_dir, failed = None, None, False
    if target.launch:
        ctx = max(final_lengths(convs, mt)) + 64
        server = plan_server(target.launch, model, threads, mt.concurrency, ctx, server_args)
        data_dir, server.data_dir = server.data_dir, None      # kept over the restart, removed at the end
        emit("launch", label=target.label, cmd=" ".join(server.cmd))
    turns: list[Turn] = []
    disk: dict[str, float] = {}
    plan = [("first turns" if t == 0 else "returns", t) for t in range(mt.turns)]
    if server:
        plan.append(("after restart", mt.turns))
    try:
        if server:
            server.start()
            target.base_url, target.backend = server.base_url, server.backend
        served = server.model_name() if server else None
        for phase, t in plan:
            if phase == "after restart":
                server.stop(keep_log=failed)
                server.start()
            if t == 0 or phase == "after restart":
                asyncio.run(warmup(target.base_url, ServeConfig(timeout_s=mt.timeout_s), target.backend, served,
                                   api_key))
            before = _disk_blocks_read(target.base_url, api_key)
            order = list(range(len(convs)))
            rng.shuffle(order)
            done = asyncio.run(run_round(target.base_url, convs, t, phase, mt, order, target.backend, served,
                                         api_key))
            after = _disk_blocks_read(target.base_url, api_key)
            if before is not None and after is not None:
                disk[phase] = disk.get(phase, 0.0) + after - before
            turns += done
            failed = failed or any(x.error for x in done)
            emit("phase", label=target.label, phase=phase, n=len(done))
    finally:
        if server:
            server.stop(keep_log=failed or len(turns) < len(plan) * len(convs))
        if data_dir:
            shutil.rmtree(data_dir, ignore_errors=True)
    return {"turns": turns, "disk_blocks": disk}


def phase_stats(turns: list[Turn]) -> dict:
    ok = [t for t in turns if not t.error]
    ttft = np.asarray([t.ttft_s for t in ok]) * 1000.0
    known = [t for t in ok if t.cached_tokens is not None]
    prompt = sum(t.prompt_tokens for t in known)
    return {"requests": len(turns), "failed": len(turns) - len(ok),
            "prompt_tokens": sum(t.prompt_tokens for t in ok),
            "cached_tokens": sum(t.cached_tokens for t in known) if known else None,
            "hit_rate": sum(t.cached_tokens for t in known) / prompt if known and prompt else None,
            "ttft_median_ms": float(np.median(ttft)) if len(ttft) else None,
            "ttft_p90_ms": float(np.percentile(ttft, 90)) if len(ttft) else None}


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.1f}%"


def multi_turn_table(runs: list[dict]) -> str:
    """One column per run, rows per phase; then each run's median TTFT and hit rate against the first's."""
    rows = []
    for phase in PHASES:
        stats = [r["phases"].get(phase) for r in runs]
        if not any(stats):
            continue
        none = {"requests": 0, "failed": 0, "hit_rate": None, "ttft_median_ms": None, "ttft_p90_ms": None}
        stats = [s or none for s in stats]
        rows += [(f"{phase}: requests (failed)", [f"{s['requests']} ({s['failed']})" for s in stats]),
                 (f"{phase}: prefix-hit rate", [_pct(s["hit_rate"]) for s in stats]),
                 (f"{phase}: median TTFT (ms)", [_fmt(s["ttft_median_ms"], ",.1f") for s in stats]),
                 (f"{phase}: p90 TTFT (ms)", [_fmt(s["ttft_p90_ms"], ",.1f") for s in stats])]
        if any(phase in r["disk_blocks"] and r["disk_blocks"][phase] for r in runs):
            rows.append((f"{phase}: blocks read from the disk tier",
                         [_fmt(r["disk_blocks"].get(phase), ",.0f") for r in runs]))
    head = "| metric | " + " | ".join(r["label"] for r in runs) + " |"
    lines = [head, "|---|" + "---:|" * len(runs)] + [f"| {k} | " + " | ".join(v) + " |" for k, v in rows]
    base = runs[0]
    for r in runs[1:]:
        parts = []
        for phase in PHASES[1:]:
            a, b = base["phases"].get(phase), r["phases"].get(phase)
            if a and b and a["ttft_median_ms"] and b["ttft_median_ms"] is not None:
                parts.append(f"{phase}: median TTFT {b['ttft_median_ms'] / a['ttft_median_ms']:.2f}x, "
                             f"prefix-hit rate {_pct(b['hit_rate'])} vs {_pct(a['hit_rate'])}")
        same = sum(x == y for x, y in zip(base["answers"], r["answers"]) if x and y)
        parts.append(f"answers the same as {base['label']}'s: {same} of {len(r['answers'])}")
        lines.append(f"\n{r['label']} vs {base['label']}: " + "; ".join(parts))
    return "\n".join(lines)


def multi_turn_command(targets: list, tokenizer, model: str | None, threads: int, api_key: str | None, out_dir,
                       server_args: list[str] | None, plan_server, mt: MultiTurnConfig, tiers: str) -> None:
    """Each target in turn; a launched kvserve once per tier (`ram,disk`)."""
    names = [t.strip() for t in tiers.split(",") if t.strip()]
    if not names or any(n not in TIERS for n in names):
        raise InvalidRequest("--kv-tiers: a list of ram, disk (e.g. ram,disk)", param="kv_tiers")
    user_args = list(server_args or [])
    if "ram" in names and _arg(user_args, "--kv-offload-dir") is not None:
        raise InvalidRequest("--kv-tiers ram runs without a disk tier: drop --server-arg=--kv-offload-dir, "
                             "or give --kv-tiers disk", param="kv_tiers")
    convs = conversations(tokenizer, mt)
    pool, pool_note = pool_args(model, user_args, convs, mt) if any(t.launch == "kvserve" for t in targets) \
        else ([], "")
    runs = []
    for t in targets:
        plans = [(f"{t.label} {TIERS[n]}", n) for n in names] if t.launch == "kvserve" else [(t.label, None)]
        for label, tier in plans:
            args, tmp = None, None
            if t.launch == "kvserve":
                args = user_args + pool
                if tier == "disk" and _arg(user_args, "--kv-offload-dir") is None:
                    tmp = tempfile.mkdtemp(prefix="kvserve-bench-kv-")
                    args += [f"--kv-offload-dir={tmp}"]
            try:
                out = run_scenario(Target(label, base_url=t.base_url, launch=t.launch, backend=t.backend), convs,
                                   mt, model=model, threads=threads, api_key=api_key, server_args=args,
                                   plan_server=plan_server,
                                   emit=lambda kind, **i: console.print(f"starting {i['cmd']}" if kind == "launch"
                                                                        else f"{i['label']}: {i['phase']} done"))
            finally:
                if tmp:
                    shutil.rmtree(tmp, ignore_errors=True)
            turns = out["turns"]
            errors = [x.error for x in turns if x.error]
            if errors:
                console.print(f"{label}: {len(errors)} turns failed; first: {errors[0]}")
            runs.append({"label": label, "phases": {p: phase_stats([x for x in turns if x.phase == p])
                                                    for p in PHASES if any(x.phase == p for x in turns)},
                         "disk_blocks": out["disk_blocks"], "answers": [x.answer for x in turns],
                         "turns": [{k: v for k, v in asdict(x).items() if k != "answer"} for x in turns]})
    table = multi_turn_table(runs)
    print(f"multi-turn scenario: {mt.conversations} conversations x {mt.turns} turns (+1 after a restart), "
          f"documents of {mt.system_len} tokens, questions of {mt.user_len}, answers of {mt.output_len}, "
          f"concurrency {mt.concurrency}" + (f", {pool_note}" if pool_note else "")
          + f", {threads} threads, load average {os.getloadavg()[0]:.1f}\n")
    print(table)
    write_outputs(out_dir, "serve-multi-turn", table, [{**r, "config": asdict(mt)} for r in runs])
