"""`kvserve bench serve`: the command line of the serving benchmark (bench/serve.py is the load
generator and its metrics, bench/serve_launch.py starts the servers under test, bench/scenario.py
the long-prompt scenario, bench/batch.py the batch one, bench/multi_turn.py the multi-turn one)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from kvserve.bench.common import console, progress, write_outputs
from kvserve.bench.serve import BACKENDS, ServeConfig, parse_goodput, profile_table, sample_requests
from kvserve.bench.serve_launch import Target, bench_target, markdown_table, plan_server, save_chart
from kvserve.errors import InvalidRequest, KVServeError


def serve_command(
    base_url: Annotated[list[str] | None, typer.Option(
        "--base-url", help="A running OpenAI-compatible server (repeatable), e.g. http://127.0.0.1:8000.")] = None,
    launch: Annotated[list[str] | None, typer.Option(
        help="Start this server on a free port first: kvserve, llama-cpp (repeatable; run one after another).")] = None,
    backend: str = typer.Option("kvserve", help="Extras --base-url servers understand: kvserve, llama-cpp, openai."),
    model: str = typer.Option(None, help="Model for prompts' tokenizer and launched servers (default: SmolLM2)."),
    endpoint: str = typer.Option("chat", help="chat (/v1/chat/completions) or completions (/v1/completions)."),
    num_prompts: int = typer.Option(64, "--num-prompts", min=1),
    concurrency: int = typer.Option(None, "--concurrency", min=1, help="Most requests in flight (default: no cap; "
                                    "multi-turn scenario 1)."),
    request_rate: float = typer.Option(math.inf, "--request-rate", help="Requests/s, Poisson arrivals (inf: all at once)."),
    burstiness: float = typer.Option(1.0, help="Gamma shape of arrival gaps (1.0: Poisson)."),
    input_len: int = typer.Option(128, "--input-len", min=1, help="Prompt tokens."),
    output_len: int = typer.Option(None, "--output-len", min=1, help="Output tokens (EOS ignored where supported; "
                                   "default 128, multi-turn scenario 32)."),
    range_ratio: float = typer.Option(0.0, help="Draw lengths uniformly from len*[1-r, 1+r] (0: fixed)."),
    repeat_ratio: float = typer.Option(0.0, help="This share of the requests (the last) repeat earlier prompts word "
                                       "for word: a workload for the semantic cache (use a small --concurrency)."),
    seed: int = typer.Option(0),
    goodput: Annotated[list[str] | None, typer.Option(help="SLOs in ms for goodput: ttft:500 tpot:100 e2el:20000.")] = None,
    threads: int = typer.Option(2, min=1, help="CPU threads for launched servers."),
    api_key: str = typer.Option(None, envvar="OPENAI_API_KEY", help="Bearer key for --base-url servers."),
    out_dir: Annotated[Path, typer.Option(help="Where serve.md, serve.json and serve.png go.")] = Path("runs/bench"),
    profile: bool = typer.Option(False, "--profile", help="Print each kvserve server's time per step phase "
                                 "(schedule, forward, sample, detokenize, HTTP/SSE, ...) during the load."),
    scenario: str = typer.Option("default", help="default, or long-prompt: short probes' TTFT and streams' ITL "
                                 "alone, under load, and while long prompts prefill (bench/scenario.py); or batch: a "
                                 "stream's ITL beside a Batch API job of --num-prompts lines (bench/batch.py); or "
                                 "multi-turn: conversations coming back after their prefix was evicted and after a "
                                 "restart, RAM only against the disk tier (bench/multi_turn.py); or repeat: speculation off, "
                                 "ngram, suffix and ngram+suffix on an agent-like loop and on open chat, single stream, "
                                 "greedy, in this process (bench/repeat.py; --num-prompts default 24)."),
    long_len: int = typer.Option(7000, "--long-len", min=1, help="long-prompt scenario: the long prompts' tokens."),
    conversations: int = typer.Option(8, "--conversations", min=1, help="multi-turn scenario: conversations, each "
                                      "with a document of its own as the system message."),
    turns: int = typer.Option(3, "--turns", min=1, help="multi-turn scenario: turns per conversation before the "
                              "restart (each re-sends the whole history)."),
    system_len: int = typer.Option(1500, "--system-len", min=1, help="multi-turn scenario: each document's tokens."),
    user_len: int = typer.Option(48, "--user-len", min=1, help="multi-turn scenario: each question's tokens."),
    kv_tiers: str = typer.Option("ram,disk", "--kv-tiers", help="multi-turn scenario, launched kvserve: one run "
                                 "per tier, side by side: ram (RAM only), disk (--kv-offload-dir in a temp dir)."),
    server_arg: Annotated[list[str] | None, typer.Option(
        "--server-arg", help="Extra argument for a launched kvserve (repeatable): --server-arg=--max-step-ms=100")] = None,
    conversation_writers: int = typer.Option(0, "--conversation-writers", min=0,
                                             help="Loops appending to saved conversations during the load "
                                                  "(kvserve servers)."),
    response_format: str = typer.Option(None, help="A response_format JSON (text or @file) sent with every request."),
    new_schema: bool = typer.Option(False, "--new-schema-per-request", help="Make each json_schema distinct."),
    lora_adapters: int = typer.Option(0, "--lora-adapters", min=0,
                                      help="Launched kvserve: serve this many random LoRA adapters (rank "
                                           "--lora-rank, all projections) and spread the requests over them."),
    lora_rank: int = typer.Option(8, "--lora-rank", min=1),
) -> None:
    """Serving benchmark: streaming requests against OpenAI-compatible servers, vLLM's metrics side by side."""
    from kvserve.model.registry import resolve
    from kvserve.tokenizer import Tokenizer

    targets = [Target(label=u, base_url=u, backend=backend) for u in base_url or []]
    targets += [Target(label=name, launch=name) for name in launch or []]
    try:
        if scenario == "repeat":      # in this process: four engines on one model (bench/repeat.py)
            from kvserve.bench.repeat import repeat_command

            return repeat_command(model, num_prompts if num_prompts != 64 else 24, output_len or 96, threads, out_dir)
        if backend not in BACKENDS:
            raise InvalidRequest(f"--backend must be one of {', '.join(BACKENDS)}", param="backend")
        if not targets:
            raise InvalidRequest("give --base-url URL or --launch kvserve / --launch llama-cpp")
        if output_len is None:
            output_len = 32 if scenario == "multi-turn" else 128
        cfg = ServeConfig(num_prompts=num_prompts, concurrency=concurrency, request_rate=request_rate,
                          burstiness=burstiness, input_len=input_len, output_len=output_len,
                          range_ratio=range_ratio, endpoint=endpoint, seed=seed, goodput=parse_goodput(goodput),
                          repeat_ratio=repeat_ratio,
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
        if scenario == "batch":
            from kvserve.bench.batch import BatchScenario, batch_command

            return batch_command(targets, model, threads, api_key, out_dir, server_arg, plan_server,
                                 BatchScenario(lines=num_prompts, stream_len=output_len))
        if scenario == "multi-turn":
            from kvserve.bench.multi_turn import MultiTurnConfig, multi_turn_command

            mt = MultiTurnConfig(conversations=conversations, turns=turns, system_len=system_len, user_len=user_len,
                                 output_len=output_len, concurrency=concurrency or 1, seed=seed)
            return multi_turn_command(targets, tokenizer, model, threads, api_key, out_dir, server_arg, plan_server,
                                      mt, kv_tiers)
        if scenario != "default":
            raise InvalidRequest(f"--scenario {scenario!r}: choose default, long-prompt or batch (single requests), "
                                 "multi-turn (conversations) or repeat", param="scenario")
        requests = sample_requests(tokenizer, cfg)
        if lora_adapters:
            server_arg = list(server_arg or []) + _lora_adapters(model, lora_adapters, lora_rank, out_dir)
            for i, r in enumerate(requests):
                r.model = f"lora{i % lora_adapters}"
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
                    console.print(f"{info['label']}: {info['n']} requests failed; first: {info['first']}"
                                  + (f" (server log: {info['log']})" if info.get("log") else ""))
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
        if "pools" in m.extra:
            from kvserve.bench.pools import pools_line
            table += "\n\n" + pools_line(m.label, m.extra["pools"])
        if "profile" in m.extra:
            table += f"\n\n{m.label} step profile: " + profile_table(m.extra["profile"])
    print(table)
    write_outputs(out_dir, "serve", table, [asdict(m) for m in results])
    save_chart(results, str(out_dir / "serve.png"))
    console.print(f"wrote {out_dir}/serve.md, serve.json, serve.png")



def _lora_adapters(model: str | None, n: int, rank: int, out_dir: Path) -> list[str]:
    """Write n random adapters for `model` under out_dir/adapters; the server's --lora arguments."""
    from kvserve.model.loader import load_model
    from kvserve.train.lora import random_adapter

    cfg = load_model(model).config
    args = []
    for i in range(n):
        path = random_adapter(out_dir / "adapters" / f"lora{i}", cfg, seed=i, rank=rank)
        args += [f"--lora=lora{i}={path}"]
    return args + [f"--max-loras={n}"]
