"""The `kvserve quantize` command (a thin layer over train/quantize.py)."""

from __future__ import annotations

import json

import typer

from kvserve.cli_errors import user_errors


def quantize_cmd(
    model: str = typer.Argument(None, help="HF directory, kvserve checkpoint (dir or .pt), .gguf file or built-in "
                                "name; default: the built-in model."),
    type: str = typer.Option(..., "--type", help="q8_0 | q4_0 | q4_1 | q4_k | q6_k"),
    out: str = typer.Option(..., "--out", help="The GGUF file to write."),
    calibrate: str = typer.Option(None, "--calibrate", help="Text file: search activation-aware (AWQ-style) "
                                  "per-channel scales on it before rounding."),
    calib_tokens: int = typer.Option(4096, "--calib-tokens", min=64, help="Calibration tokens to use."),
    eval_text: str = typer.Option(None, "--eval-text", help="Held-out text for the perplexity columns "
                                  "(default: the bundled held-out split)."),
    eval_windows: int = typer.Option(8, "--eval-windows", min=1),
    seq_len: int = typer.Option(256, "--seq-len", min=8),
    no_eval: bool = typer.Option(False, "--no-eval", help="Skip the perplexity columns."),
    threads: int = typer.Option(None, "--threads", min=1),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Quantize a model to a GGUF file (llama.cpp loads it too); prints bytes and perplexity before/after."""
    from kvserve.train.quantize import QuantizeConfig, quantize

    if threads:
        import torch

        torch.set_num_threads(threads)
    with user_errors(os_error=lambda e: f"{e.filename or ''}: {e.strerror}"):
        s = quantize(QuantizeConfig(model=model, type=type, out=out, calibrate=calibrate, calib_tokens=calib_tokens,
                                    eval_text=eval_text, eval_windows=eval_windows, seq_len=seq_len,
                                    evaluate=not no_eval))
    if as_json:
        rows = [{"model": r["model"], "bytes": r["bytes"], **(r["result"].as_dict() if "result" in r else {})}
                for r in s["rows"]]
        typer.echo(json.dumps({**{k: v for k, v in s.items() if k not in ("rows", "table")}, "rows": rows}, indent=2))
        return
    typer.echo(s["table"])
    typer.echo(f"wrote {s['out']} ({', '.join(f'{n} {t}' for t, n in s['types'].items())}) in {s['seconds']} s")
