"""`kvserve bench ...`: benchmarks with progress bars, a markdown table and a PNG chart.

This module holds the `latency` and `kernels` commands and registers the others (serve,
throughput) from their modules; the helpers they share are in `kvserve.bench.common`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from kvserve.bench.common import OUT_DIR, console, progress, progress_events, write_outputs
from kvserve.bench.serve_cli import serve_command
from kvserve.bench.throughput import throughput
from kvserve.engine.spec_decode.config import NUM_SPEC_HELP
from kvserve.errors import InvalidRequest, KVServeError

app = typer.Typer(no_args_is_help=True, help="Benchmarks: latency (prefill/decode), kernels; peers side by side.")


@app.command()
def latency(
    model: str = typer.Option(None, help="Model name or path (default: SmolLM2-135M-Instruct Q4_1)."),
    prompt_tokens: int = typer.Option(512, "--prompt-tokens", "-n", min=1, help="Prompt length for prefill."),
    input_len: str = typer.Option(None, "--input-len", help="Several prompt lengths, e.g. 512,2048,8000: one "
                                                            "table row per engine and length."),
    decode_tokens: int = typer.Option(128, "--decode-tokens", "-m", min=1, help="Tokens to decode, batch 1."),
    repeats: int = typer.Option(3, min=1, help="Runs per engine; the best is reported."),
    threads: int = typer.Option(2, min=1, help="CPU threads for every engine."),
    weight_format: str = typer.Option("auto", help="kvserve weight format: auto, gguf, fp32, bf16, fp16, q8_0."),
    peer: Annotated[list[str] | None, typer.Option(help="Also run: llama-cpp, transformers (repeatable).")] = None,
    kv_cache_dtype: Annotated[list[str] | None, typer.Option(
        "--kv-cache-dtype", help="kvserve's KV cache: fp16 (default), bf16, fp32, int8; repeat for an A/B "
                                 "(runs interleaved, one row each).")] = None,
    out_dir: Annotated[Path, typer.Option(help="Where the table (.md, .json) and chart (.png) go.")] = OUT_DIR,
    busy_cores: int = typer.Option(0, "--busy-cores", min=0, help="Also measure every engine beside this many "
                                   "spinning processes (a busy machine): each run quiet, then busy, back to back; "
                                   "a row each, with the share of the quiet figures kept."),
    speculative: str = typer.Option(None, "--speculative", help="Instead: grounded and open chat prompts through "
                                    "the engine, greedy, with this proposer (ngram, draft:PATH, "
                                    "ngram+draft:PATH) and without."),
    num_speculative_tokens: int = typer.Option(None, "--num-speculative-tokens", help=NUM_SPEC_HELP),
    spec_workloads: str = typer.Option("grounded,open", "--spec-workloads",
                                       help="With --speculative: which workloads (grounded, open)."),
) -> None:
    """Prefill tokens/s of an N-token prompt and single-stream decode tokens/s for M tokens."""
    from kvserve.bench.latency import LatencyConfig, markdown_table, run_latency, save_chart

    if speculative or num_speculative_tokens is not None:
        _spec_latency(model, speculative or "ngram", num_speculative_tokens, decode_tokens, repeats, threads, out_dir,
                      [w.strip() for w in spec_workloads.split(",") if w.strip()])
        return

    try:
        lengths = [int(x) for x in input_len.split(",")] if input_len else [prompt_tokens]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        console.print(f"error: --input-len takes positive integers separated by commas, got {input_len!r}")
        raise typer.Exit(2)
    results = []
    load_at_start = os.getloadavg()[0]
    for n in lengths:
        cfg = LatencyConfig(model=model, prompt_tokens=n, decode_tokens=decode_tokens, repeats=repeats,
                            threads=threads, weight_format=weight_format, peers=list(peer or []),
                            kv_cache_dtypes=list(kv_cache_dtype or ["fp16"]), busy_cores=busy_cores)
        with progress() as prog:
            try:
                results += run_latency(cfg, progress_events(prog))
            except KVServeError as e:
                console.print(f"error: {e.message}")
                raise typer.Exit(1) from None
    table = markdown_table(results)
    busy = f", quiet and beside {busy_cores} spinning processes back to back" if busy_cores else ""
    print(f"prompt {','.join(map(str, lengths))} tokens, decode {decode_tokens} tokens, {threads} threads, best of {repeats}"
          f"{busy}, load average {load_at_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end\n")
    print(table)
    fp_rows = [r.footprint for r in results if r.footprint]
    if fp_rows:
        from kvserve.bench.footprint import footprint_table

        table += "\n\n" + footprint_table(fp_rows)
        print("\n" + footprint_table(fp_rows))
    data = [{**r.__dict__, "prefill_tps": r.prefill_tps, "decode_tps": r.decode_tps} for r in results]
    write_outputs(out_dir, "latency", table, data)
    save_chart(results, str(out_dir / "latency.png"))
    console.print(f"wrote {out_dir}/latency.md, latency.json, latency.png")


def _spec_latency(model: str | None, speculative: str, k: int | None, decode_tokens: int, repeats: int,
                  threads: int, out_dir: Path, workloads: list[str]) -> None:
    from kvserve.bench.spec_latency import WORKLOADS, run_spec_latency, spec_markdown_table
    from kvserve.engine.spec_decode.config import SpeculativeConfig

    try:
        SpeculativeConfig.parse(speculative, k)
        bad = [w for w in workloads if w not in WORKLOADS]
        if bad or not workloads:
            raise InvalidRequest(f"unknown workload {bad[0] if bad else ''!r}: use {', '.join(WORKLOADS)}")
        with progress() as prog:
            task = prog.add_task("speculative", total=repeats * sum(len(WORKLOADS[w]) for w in workloads))
            rows = run_spec_latency(model, speculative, k, decode_tokens, repeats, threads,
                                    lambda: prog.advance(task, 1), workloads)
    except KVServeError as e:
        console.print(f"error: {e.message}")
        raise typer.Exit(1) from None
    table = spec_markdown_table(rows)
    print(f"greedy, up to {decode_tokens} tokens per answer, single stream, {threads} threads, best of {repeats} "
          "(paired: each prompt against the baseline run just before it), "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print(table)
    write_outputs(out_dir, "latency_speculative", table,
                  [{**r.__dict__, "decode_tps": r.decode_tps, "paired_median": r.paired_median} for r in rows])
    console.print(f"wrote {out_dir}/latency_speculative.md, latency_speculative.json")


@app.command()
def kernels(
    tokens: Annotated[list[int] | None, typer.Option("--tokens", "-t", help="Rows of x per call (T).")] = None,
    threads: int = typer.Option(2, min=1, help="CPU threads."),
    out_dir: Annotated[Path, typer.Option(help="Where the table (.md, .json) goes.")] = OUT_DIR,
) -> None:
    """Each Linear variant alone on the default model's weight shapes, vs torch fp32 and bf16 matmul."""
    from kvserve.bench.kernel_latency import MODEL_SHAPES, kernel_latency, kernel_table

    tokens = list(tokens or [1, 7, 64, 512])
    with progress() as prog:
        task = prog.add_task("kernels", total=len(MODEL_SHAPES) * len(tokens))
        rows = kernel_latency(tokens, threads=threads, progress=lambda n: prog.advance(task, n))
    table = kernel_table(rows)
    print(f"{threads} threads, median µs per call, load average {os.getloadavg()[0]:.1f}\n")
    print(table)
    write_outputs(out_dir, "kernels", table, rows)


# `kvserve bench serve` (the HTTP load generator) and `kvserve bench throughput` (offline, many
# requests at once) live in their own modules; registered here.
app.command("serve")(serve_command)
app.command("throughput")(throughput)
