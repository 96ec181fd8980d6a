"""`kvserve bench latency`: prefill and single-stream decode tokens/s, kvserve and peers side by side.

Each runner feeds the same prompt token ids to its engine and times two things:
  prefill  one forward pass over an N-token prompt (up to the last token's logits)
  decode   M further tokens, one forward pass each, greedy, batch size 1
and reports tokens/s as N / prefill seconds and M / decode seconds, the best of `repeats` runs
(llama-bench reports the mean; the best is less sensitive to other work on a shared machine).
kvserve runs its model directly over the paged KV cache, as the engine's model runner does,
without the scheduler: this measures the model and kernels, the part llama.cpp's eval measures.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.bench import footprint
from kvserve.bench.common import save_bar_charts, transformers_peer
from kvserve.engine.model_runner import TRIM_AFTER_TOKENS, TRIM_MIN_FREE
from kvserve.model.attention import AttentionMetadata
from kvserve.model.kv_quant import cache_shape
from kvserve.model.loader import release_freed_heap

Progress = Callable[[int], None]


@dataclass
class LatencyConfig:
    model: str | None = None          # kvserve model name or path (default: SmolLM2-135M-Instruct Q4_1)
    prompt_tokens: int = 512
    decode_tokens: int = 128
    repeats: int = 3
    threads: int = 2
    weight_format: str = "auto"
    peers: list[str] = field(default_factory=list)   # "llama-cpp", "transformers"
    seed: int = 0
    # kvserve's KV cache dtypes; several: one row each, their runs interleaved over one loaded model
    kv_cache_dtypes: list[str] = field(default_factory=lambda: ["fp16"])
    # > 0: every run is made twice, back to back, quiet and beside this many spinning processes
    # (bench/busy.py), each engine under the same load; a row each
    busy_cores: int = 0


@dataclass
class LatencyResult:
    engine: str
    detail: str
    prompt_tokens: int
    decode_tokens: int
    prefill_s: float
    decode_s: float
    footprint: dict | None = None     # kvserve: time to ready, RSS, bytes per token (bench/footprint.py)
    busy_cores: int = 0               # spinning processes beside the runs of this row

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s


def prompt_ids(vocab_size: int, n: int, seed: int) -> list[int]:
    """A fixed pseudo-random prompt (ids from the ordinary-token range, no specials)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab_size, 30000), (n,), generator=g).tolist()


class _Runner:
    """Times one greedy generation the same way for every engine: `prefill(ids)` returns the
    first token, then `decode(token)` is called `decode_tokens` times, each returning the next.
    A runner keeps its own position or cache between the calls."""

    name: str

    def prefill(self, ids: list[int]) -> int:
        raise NotImplementedError

    def decode(self, tok: int) -> int:
        raise NotImplementedError

    @torch.inference_mode()
    def run(self, ids: list[int], decode_tokens: int, progress: Progress | None = None) -> tuple[float, float]:
        """(prefill seconds, decode seconds)."""
        t0 = time.perf_counter()
        tok = self.prefill(ids)
        t1 = time.perf_counter()
        for _ in range(decode_tokens):
            tok = self.decode(tok)
            if progress:
                progress(1)
        return t1 - t0, time.perf_counter() - t1


class KvserveRunner(_Runner):
    """kvserve's model on its paged KV cache: one sequence, block size 16."""

    name = "kvserve"

    def __init__(self, cfg: LatencyConfig):
        from kvserve.engine.config import EngineConfig
        from kvserve.model.loader import load_model

        torch.set_num_threads(cfg.threads)
        t0 = time.perf_counter()
        self.loaded = load_model(cfg.model, cfg.weight_format)
        self.model = self.loaded.model
        c = self.loaded.config
        self.block_size = 16
        n_blocks = (cfg.prompt_tokens + cfg.decode_tokens + self.block_size) // self.block_size + 1
        self.caches = {}
        for name in cfg.kv_cache_dtypes or ["fp16"]:
            kv_dtype = EngineConfig(kv_cache_dtype=name).torch_kv_dtype
            shape = cache_shape(n_blocks, self.block_size, c.num_key_value_heads, c.head_dim, kv_dtype)
            self.caches[name] = [torch.zeros(shape, dtype=kv_dtype) for _ in range(c.num_hidden_layers)]
        self.weight_format = cfg.weight_format
        self.use(next(iter(self.caches)))
        self.block_table = list(range(n_blocks))
        self.prefill([100])                                         # ready: the first token is out
        self.footprint = footprint.measure(self, time.perf_counter() - t0, cfg)

    def use(self, kv_name: str) -> None:
        """Run on the KV cache of dtype `kv_name` (one of cfg.kv_cache_dtypes)."""
        self.kv_caches = self.caches[kv_name]
        dtype = str(self.kv_caches[0].dtype).removeprefix("torch.")
        self.name = "kvserve" if kv_name == next(iter(self.caches)) else f"kvserve {dtype} KV"
        self.detail = (f"{self.loaded.source.name} ({self.weight_format}, {dtype} KV cache), "
                       f"{torch.get_num_threads()} threads")

    @property
    def vocab_size(self) -> int:
        return self.loaded.config.vocab_size

    def _step(self, ids: list[int], start: int) -> int:
        n = len(ids)
        meta = AttentionMetadata.build([n], [start + n], [self.block_table], self.block_size)
        positions = torch.arange(start, start + n)
        hidden = self.model(torch.tensor(ids), positions, meta, self.kv_caches)
        logits = self.model.compute_logits(hidden[-1:])
        self.model.backend.sync_torch_threads()   # as the engine's step does
        tok = int(logits[0].argmax())
        if n >= TRIM_AFTER_TOKENS:      # and this (engine/model_runner.py)
            del hidden, logits
            release_freed_heap(TRIM_MIN_FREE)
        return tok

    def prefill(self, ids: list[int]) -> int:
        self._pos = len(ids)
        return self._step(ids, 0)

    def decode(self, tok: int) -> int:
        tok = self._step([tok], self._pos)
        self._pos += 1
        return tok


class LlamaCppRunner(_Runner):
    """llama-cpp-python on the same GGUF file (pip install 'kvserve[llama-cpp]')."""

    name = "llama.cpp"

    def __init__(self, cfg: LatencyConfig):
        try:
            import llama_cpp
        except ImportError:
            from kvserve.errors import InvalidRequest

            raise InvalidRequest("--peer llama-cpp needs llama-cpp-python: pip install 'kvserve[llama-cpp]'",
                                 param="peer") from None
        from kvserve.model.registry import resolve

        path = resolve(cfg.model).path
        n_ctx = cfg.prompt_tokens + cfg.decode_tokens + 16
        t0 = time.perf_counter()
        # n_batch = n_ctx: llama-cpp-python keeps n_batch rows of scores and indexes them by position
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=512,
                                   n_threads=cfg.threads, n_threads_batch=cfg.threads, verbose=False)
        self.vocab_size = self.llm.n_vocab()
        self.prefill([100])                                         # ready: the first token is out, as kvserve's
        ready_s = time.perf_counter() - t0
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()
        size = path.stat().st_size      # read per decode token: about the whole file (no KV term here)
        self.footprint = footprint.Footprint(ready_s, footprint.rss(), size, size, 0, footprint.measure_bandwidth())
        self.detail = f"llama-cpp-python {llama_cpp.__version__}, {path.name}, {cfg.threads} threads"

    def run(self, ids: list[int], decode_tokens: int, progress: Progress | None = None) -> tuple[float, float]:
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()
        return super().run(ids, decode_tokens, progress)

    def prefill(self, ids: list[int]) -> int:
        return self._eval_next(ids)

    def decode(self, tok: int) -> int:
        return self._eval_next([tok])

    def _eval_next(self, ids: list[int]) -> int:
        """Evaluate `ids` after what the context holds; the greedy next token."""
        self.llm.eval(ids)
        return int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))


class TransformersRunner(_Runner):
    """Hugging Face transformers on fp32 weights dequantized from the same GGUF."""

    name = "transformers"

    def __init__(self, cfg: LatencyConfig):
        import transformers

        self.model, path = transformers_peer(cfg.model, cfg.threads)
        self.vocab_size = self.model.config.vocab_size
        self.detail = f"transformers {transformers.__version__}, fp32 from {path.name}, {cfg.threads} threads"

    def prefill(self, ids: list[int]) -> int:
        out = self.model(torch.tensor([ids]), use_cache=True)
        self._past = out.past_key_values
        return int(out.logits[0, -1].argmax())

    def decode(self, tok: int) -> int:
        out = self.model(torch.tensor([[tok]]), past_key_values=self._past, use_cache=True)
        self._past = out.past_key_values
        return int(out.logits[0, -1].argmax())


RUNNERS = {"kvserve": KvserveRunner, "llama-cpp": LlamaCppRunner, "transformers": TransformersRunner}


def _measure(key: str, cfg: LatencyConfig, emit: Callable[..., None]) -> list[LatencyResult]:
    """Best-of-repeats for one engine; kvserve with several KV dtypes gives a row per dtype, its
    runs interleaved (A, B, A, B, ...) so machine load drifts hit every variant alike. With
    cfg.busy_cores, each run is made quiet and then busy, back to back: a row for each."""
    from kvserve.bench.busy import BusyCores

    runner = RUNNERS[key](cfg)
    variants = list(getattr(runner, "caches", None) or [None])
    loads = [0, cfg.busy_cores] if cfg.busy_cores else [0]
    ids = prompt_ids(runner.vocab_size, cfg.prompt_tokens, cfg.seed)
    emit("start", engine=runner.name,
         total=len(variants) * (cfg.repeats * len(loads) + 1) * (cfg.decode_tokens + 1))
    best = {}
    for v in variants:
        if v is not None:
            runner.use(v)
        runner.run(ids[: min(32, len(ids))], min(4, cfg.decode_tokens))   # warm-up: threads, caches
        emit("advance", n=cfg.decode_tokens + 1)
        for load in loads:
            best[v, load] = [float("inf"), float("inf"), runner.name, runner.detail, load]
    for _ in range(cfg.repeats):
        for v in variants:
            if v is not None:
                runner.use(v)
            for load in loads:
                with BusyCores(load):
                    p, d = runner.run(ids, cfg.decode_tokens, lambda n: emit("advance", n=n))
                emit("advance", n=1)
                b = best[v, load]
                b[0], b[1] = min(b[0], p), min(b[1], d)
    fp = getattr(runner, "footprint", None)
    if fp is not None:
        fp.rss_end = footprint.rss()    # what the process holds once it has run the prompts
    return [LatencyResult(name, detail, cfg.prompt_tokens, cfg.decode_tokens, p, d,
                          None if fp is None or load else {"engine": name, **fp.row(cfg.decode_tokens / d)}, load)
            for p, d, name, detail, load in best.values()]


def _peer_main(key: str, cfg: LatencyConfig, queue) -> None:
    try:
        res = _measure(key, cfg, lambda kind, **info: queue.put((kind, info)))
        queue.put(("result", {"result": res}))
    except Exception as e:  # noqa: BLE001 - reported to the parent as a failed row
        queue.put(("error", {"message": f"{type(e).__name__}: {e}"}))


def _measure_in_subprocess(key: str, cfg: LatencyConfig, emit: Callable[..., None]) -> list[LatencyResult]:
    """A peer runs in its own process: its threads and native crashes (llama.cpp built for
    instructions this CPU lacks dies with SIGILL) cannot take the benchmark down."""
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_peer_main, args=(key, cfg, q), daemon=True)
    proc.start()
    try:
        while True:
            try:
                kind, info = q.get(timeout=1.0)
            except queue_mod.Empty:
                if not proc.is_alive():
                    code = proc.exitcode
                    why = "SIGILL: rebuild it for this CPU" if code == -4 else f"exit code {code}"
                    return _failed(key, cfg, f"failed: process died ({why})")
                continue
            if kind == "result":
                return info["result"]
            if kind == "error":
                return _failed(key, cfg, f"failed: {info['message']}")
            emit(kind, **info)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


def _failed(key: str, cfg: LatencyConfig, why: str) -> list[LatencyResult]:
    return [LatencyResult(RUNNERS[key].name, why, cfg.prompt_tokens, cfg.decode_tokens, float("nan"), float("nan"),
                          busy_cores=load) for load in ([0, cfg.busy_cores] if cfg.busy_cores else [0])]


def run_latency(cfg: LatencyConfig, on_event: Callable[..., None] | None = None) -> list[LatencyResult]:
    """Run kvserve (in this process) and each peer (in a child process), one at a time.
    on_event(kind, **info) drives progress: ("load", engine=), ("start", engine=, total=), ("advance", n=)."""
    from kvserve.errors import InvalidRequest

    emit = on_event or (lambda *a, **k: None)
    for p in cfg.peers:
        if p not in RUNNERS or p == "kvserve":
            raise InvalidRequest(f"unknown peer {p!r}; choose from llama-cpp, transformers", param="peer")
    results = []
    for key in ["kvserve", *cfg.peers]:
        emit("load", engine=key)
        results += _measure(key, cfg, emit) if key == "kvserve" else _measure_in_subprocess(key, cfg, emit)
        gc.collect()
    return results


def markdown_table(results: list[LatencyResult]) -> str:
    """One row per engine, prompt length and load; ratios against kvserve at the same length and
    load. With busy rows, two more columns: the share of its own quiet figures each row kept."""
    base = {(r.prompt_tokens, r.busy_cores): r for r in results if r.engine == "kvserve"}
    quiet = {(r.engine, r.detail, r.prompt_tokens): r for r in results if not r.busy_cores}
    busy = any(r.busy_cores for r in results)
    head = "| engine | prompt |" + (" busy cores |" if busy else "")
    head += " prefill tok/s | decode tok/s | prefill vs kvserve | decode vs kvserve |"
    head += (" prefill kept | decode kept |" if busy else "") + " detail |"
    lines = [head, "|" + "---|" * 2 + ("---:|" * (1 if busy else 0)) + "---:|" * 4 + ("---:|" * 2 if busy else "")
             + "---|"]
    for r in results:
        b = base.get((r.prompt_tokens, r.busy_cores), r)
        line = f"| {r.engine} | {r.prompt_tokens} |" + (f" {r.busy_cores} |" if busy else "")
        line += (f" {r.prefill_tps:.1f} | {r.decode_tps:.1f} | {r.prefill_tps / b.prefill_tps:.2f}x | "
                 f"{r.decode_tps / b.decode_tps:.2f}x |")
        if busy:
            q = quiet.get((r.engine, r.detail, r.prompt_tokens), r)
            line += f" {r.prefill_tps / q.prefill_tps:.0%} | {r.decode_tps / q.decode_tps:.0%} |"
        lines.append(line + f" {r.detail} |")
    return "\n".join(lines)


def save_chart(results: list[LatencyResult], path: str) -> None:
    several = len({r.prompt_tokens for r in results}) > 1
    names = [(f"{r.engine}\n{r.prompt_tokens}" if several else r.engine) + (f"\n{r.busy_cores} busy" if r.busy_cores
                                                                             else "") for r in results]
    prompt = "N" if several else str(results[0].prompt_tokens)
    colors = {"kvserve": "#3b7dd8", "llama.cpp": "#d8793b", "transformers": "#5fa55a"}
    save_bar_charts(path, names, [colors.get(r.engine, "#999999") for r in results], [
        (f"prefill, {prompt}-token prompt", [r.prefill_tps for r in results], "%.0f"),
        (f"decode, {results[0].decode_tokens} tokens, batch 1", [r.decode_tps for r in results], "%.0f"),
    ], width=9, ylabel="tokens/s")
