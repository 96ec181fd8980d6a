"""What every `kvserve bench` command shares: the stderr console, progress bars driven by a
benchmark's events, the table/JSON writer and the row of bar charts; and the transformers
peer the in-process model benches (latency, throughput) load. The command modules import it; it imports none
of them (so the import graph inside bench/ stays acyclic)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console(stderr=True)
OUT_DIR = Path("runs/bench")


def transformers_peer(model: str | None, threads: int) -> tuple[Any, Path]:
    """The transformers peer: fp32 weights dequantized from the same GGUF file as kvserve's, on
    `threads` torch threads; returns the model (eval mode) and the file's path."""
    import torch
    import transformers

    from kvserve.errors import InvalidRequest
    from kvserve.model.registry import resolve

    torch.set_num_threads(threads)
    path = resolve(model).path
    if path.suffix != ".gguf":
        raise InvalidRequest("--peer transformers loads the same GGUF file; this model is not a .gguf",
                             param="peer")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    return hf, path


def progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False)


def progress_events(prog: Progress, on_other=None):
    """An `on_event(kind, **info)` callback that drives `prog` from a benchmark's load/start/
    advance events; other kinds go to `on_other(kind, info)`."""
    tasks: dict[str, object] = {}

    def on_event(kind: str, **info) -> None:
        if kind == "load":
            console.print(f"loading {info['engine']}...")
        elif kind == "start":
            tasks["current"] = prog.add_task(f"{info['engine']:>12}", total=info["total"])
        elif kind == "advance" and "current" in tasks:
            prog.advance(tasks["current"], info["n"])
        elif on_other is not None:
            on_other(kind, info)

    return on_event


def write_outputs(out_dir: Path, stem: str, table: str, data: list[dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.md").write_text(table + "\n")
    (out_dir / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")


def save_bar_charts(path: str | Path, names: list[str], colors: list[str],
                    panels: list[tuple[str, list[float], str]], *, width: float, ylabel: str | None = None,
                    title: str = "") -> None:
    """A PNG of bar charts side by side, one per (panel title, values, bar-label format), each
    with a bar per name in `colors`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(width, 3.6), squeeze=False)
    for ax, (label, vals, fmt) in zip(axes[0], panels):
        bars = ax.bar(names, vals, color=colors)
        ax.bar_label(bars, fmt=fmt)
        ax.set_title(label)
        if ylabel:
            ax.set_ylabel(ylabel)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def wait_healthy(base_url: str, timeout_s: float = 300.0) -> bool:
    """Poll a server's /health until it answers 200 (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(base_url.rstrip("/") + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def metric_families(base_url: str, api_key: str | None = None) -> list | None:
    """A server's /metrics parsed into Prometheus metric families; None when it cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=30)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return list(text_string_to_metric_families(resp.text))
