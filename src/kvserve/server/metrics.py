"""Prometheus metrics with vLLM's names under a `kvserve:` prefix.

Latency histograms are observed by the server once per finished engine request, from the
engine's own timestamps (RequestMetrics). Gauges and cumulative counters are read from
`engine.stats()` at scrape time by a custom collector, so they cannot drift from the engine;
among them the step profile, `kvserve:phase_seconds_total{phase=...}` (see PHASE_HELP), with
`kvserve:engine_steps_total` and the batched tokens and requests to divide it by; for a MoE model,
`kvserve:moe_expert_tokens_total{layer=..., expert=...}`, the tokens each expert was routed; with
disaggregated pools, `kvserve:pool_*_total{pool=prefill|decode}` (time to first token and
inter-token latency per pool); with Ray replicas, `kvserve:replica_*{replica=...}` (each replica's
liveness, requests and tokens).
Each app has its own registry, so several apps can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvserve.outputs import RequestMetrics

P = "kvserve:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0)

# engine.stats() key -> (metric name, kind, help)
ENGINE_STATS = {
    "num_requests_running": ("num_requests_running", "gauge", "Requests in the engine's running batch."),
    "num_requests_waiting": ("num_requests_waiting", "gauge", "Requests waiting in the engine's scheduler."),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (0-1)."),
    "kv_blocks_used": ("kv_cache_blocks_used", "gauge", "KV-cache blocks held by requests."),
    "kv_cache_bytes_per_token": ("kv_cache_bytes_per_token", "gauge",
                                 "KV-cache bytes one token takes, all layers, K and V (int8 rows count their scales)."),
    "kv_cache_capacity_tokens": ("kv_cache_capacity_tokens", "gauge", "Tokens the KV-cache pool holds."),
    "prefix_cache_queries": ("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "counter", "Prompt tokens served from the prefix cache."),
    "prompt_tokens": ("prompt_tokens", "counter", "Prefill tokens processed."),
    "generation_tokens": ("generation_tokens", "counter", "Tokens generated."),
    "num_preemptions": ("num_preemptions", "counter", "Requests preempted for lack of KV blocks."),
    "num_steps": ("engine_steps", "counter", "Engine steps that ran the model."),
    "num_batched_tokens": ("batched_tokens", "counter", "Tokens in the engine steps' forward passes, summed."),
    "num_batched_requests": ("batched_requests", "counter", "Requests in the engine steps' batches, summed."),
    # the KV disk tier (--kv-offload-dir; 0 without it)
    "kv_offload_hit_blocks": ("kv_offload_hit_blocks", "counter", "KV blocks read back from the disk tier."),
    "kv_offload_written_blocks": ("kv_offload_written_blocks", "counter", "KV blocks written to the disk tier."),
    "kv_offload_dropped_blocks": ("kv_offload_dropped_blocks", "counter",
                                  "KV blocks not written: the disk tier's writer was behind."),
    "kv_offload_bytes": ("kv_offload_bytes", "gauge", "Bytes the disk tier holds."),
}
# speculative decoding (only when the engine speculates): vLLM's names
SPEC_STATS = {
    "spec_decode_num_drafts": ("spec_decode_num_drafts", "Verification rounds with at least one draft token."),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified."),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens the target accepted."),
    "spec_decode_num_lookup_drafts": ("spec_decode_num_lookup_drafts", "Rounds prompt lookup drafted (ngram+draft)."),
}
PHASE_HELP = ("Cumulative wall time per phase. In the engine (thread or process), per step: schedule, "
              "prepare (batch and attention metadata), forward (the decoder stack, attention included), logits "
              "(lm_head), sample, update (scheduler bookkeeping, stops), messages (client messages in, outputs "
              "out). On the server's event loop: output (detokenize, stop strings), http (stages, SSE/JSON "
              "formatting and writes).")


def _family(name: str, kind: str, doc: str, labels: list[str], samples: Iterable[tuple[list[str], float]]):
    """The metric family `kvserve:<name>` (kind "gauge" or "counter") with its (label values, value) samples."""
    family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(P + name, doc, labels=labels)
    for values, value in samples:
        family.add_metric(values, float(value))
    return family


def _per_model_families(table: dict[str, tuple[str, str, str]], models: dict[str, dict]) -> Iterator:
    """A family per `table` row (stats key -> (name, kind, help)), one sample per model (absent: 0)."""
    for key, (name, kind, doc) in table.items():
        yield _family(name, kind, doc, ["model_name"],
                      (([model], stats.get(key, 0) or 0) for model, stats in models.items()))


class _EngineCollector:
    """One sample per served model (`per_model`: {name: stats}; else the one model's)."""

    def __init__(self, stats: Callable[[], dict | None], model_name: Callable[[], str],
                 per_model: Callable[[], dict[str, dict]] | None = None):
        self._stats = stats
        self._model_name = model_name
        self._per_model = per_model

    def collect(self) -> Iterator:
        models = self._per_model() if self._per_model is not None else {self._model_name(): self._stats() or {}}
        if not models:
            models = {self._model_name(): {}}
        yield from _per_model_families(ENGINE_STATS, models)
        yield _family("phase_seconds", "counter", PHASE_HELP, ["model_name", "phase"],
                      (([model, phase], seconds) for model, stats in models.items()
                       for phase, seconds in (stats.get("phase_seconds") or {}).items()))
        yield from _pool_families(models)
        yield from _replica_families(models)
        yield from _spec_families(models)
        experts = _family("moe_expert_tokens", "counter", "Tokens routed to each expert of each MoE layer.",
                          ["model_name", "layer", "expert"],
                          (([model, str(layer), str(expert)], n) for model, stats in models.items()
                           for layer, counts in enumerate(stats.get("moe_expert_tokens") or [])
                           for expert, n in enumerate(counts)))
        if experts.samples:
            yield experts


# disaggregated serving (engine/ray_client.py): stats["pools"][pool] key -> (metric name, help)
POOL_STATS = {
    "requests": ("pool_requests", "Requests that got their first token from this pool."),
    "ttft_seconds_sum": ("pool_ttft_seconds", ("Summed time to first token in this pool (prefill: the prompt "
                                              "on the prefill replica; decode: from the KV hand-over).")),
    "itl_seconds_sum": ("pool_itl_seconds", "Summed inter-token gaps of this pool's streams."),
    "itl_count": ("pool_itl_tokens", "Tokens those inter-token gaps were counted over."),
}


def _pool_families(models: dict[str, dict]) -> Iterator:
    pools = {model: stats.get("pools") for model, stats in models.items() if stats.get("pools")}
    if not pools:
        return
    for key, (name, doc) in POOL_STATS.items():
        yield _family(name, "counter", doc, ["model_name", "pool"],
                      (([model, pool], values.get(key, 0)) for model, by_pool in pools.items()
                       for pool, values in by_pool.items()))


# Ray replicas (engine/ray_client.py): stats["replicas"][i] key -> (metric name, kind, help)
REPLICA_STATS = {
    "alive": ("replica_up", "gauge", "1 while the replica serves, 0 once it is gone."),
    "num_requests_running": ("replica_requests_running", "gauge", "Requests in the replica's running batch."),
    "prompt_tokens": ("replica_prompt_tokens", "counter", "Prefill tokens the replica processed."),
    "generation_tokens": ("replica_generation_tokens", "counter", "Tokens the replica generated."),
}


SUPERVISOR_STATS = {
    "replica_restarts": ("replica_restarts", "Dead replicas started again in their slot."),
    "replica_scale_ups": ("replica_scale_ups", "Replicas started because TTFT or the queue missed the target."),
    "replica_scale_downs": ("replica_scale_downs", "Replicas drained and stopped after an idle period."),
}


def _replica_families(models: dict[str, dict]) -> Iterator:
    replicas = {model: stats["replicas"] for model, stats in models.items() if stats.get("replicas")}
    if not replicas:
        return
    yield _family("replicas", "gauge", "Replica slots by state: starting, serving, draining, stopped, dead "
                  "(engine/replica_supervisor.py).", ["model_name", "state"],
                  (([model, state], n) for model, stats in models.items()
                   for state, n in (stats.get("replica_states") or {}).items()))
    for key, (name, doc) in SUPERVISOR_STATS.items():
        yield _family(name, "counter", doc, ["model_name"],
                      (([model], stats[key]) for model, stats in models.items() if key in stats))
    for key, (name, kind, doc) in REPLICA_STATS.items():
        yield _family(name, kind, doc, ["model_name", "replica", "role"],
                      (([model, str(r["index"]), r.get("role") or "serve"], r.get(key, 0) or 0)
                       for model, reps in replicas.items() for r in reps))


def _spec_families(models: dict[str, dict]) -> Iterator:
    models = {m: st for m, st in models.items() if "spec_decode_num_drafts" in st}
    if not models:
        return
    yield from _per_model_families({key: (name, "counter", doc) for key, (name, doc) in SPEC_STATS.items()}, models)
    hist = HistogramMetricFamily(P + "spec_decode_acceptance_length", "Tokens a speculating request got from "
                                 "one verification round (accepted drafts + 1).", labels=["model_name"])
    for model, stats in models.items():
        counts = stats.get("spec_decode_acceptance_length_counts") or []
        buckets, cum = [], 0
        for a, n in enumerate(counts):
            cum += n
            buckets.append((str(float(a + 1)), float(cum)))
        buckets.append(("+Inf", float(cum)))
        hist.add_metric([model], buckets, sum_value=float(sum((a + 1) * n for a, n in enumerate(counts))))
    yield hist


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict | None], model_name: Callable[[], str],
                 per_model: Callable[[], dict[str, dict]] | None = None):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        lab = ["model_name"]
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time from arrival to the first token.",
                              lab, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between consecutive output tokens.",
                             lab, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Time from arrival to the last token.",
                             lab, buckets=E2E_BUCKETS, registry=r)
        self.queue = Histogram(P + "request_queue_time_seconds",
                               "Time waiting (gateway queue + scheduler) before first scheduled.",
                               lab, buckets=E2E_BUCKETS, registry=r)
        self.success = Counter(P + "request_success", "Finished requests by finish reason.",
                               lab + ["finished_reason"], registry=r)
        self.gateway_waiting = Gauge(P + "gateway_requests_waiting",
                                     "Requests waiting in the gateway's admission queue.", registry=r)
        # the Files and Batches stores (set by the batch runner every few seconds, off the event loop)
        self.files_stored_bytes = Gauge(P + "files_stored_bytes", "Bytes of every stored file (uploads and "
                                        "batch outputs, all keys).", registry=r)
        self.files_stored = Gauge(P + "files_stored", "Stored files, all keys.", registry=r)
        self.batch_lines_stored = Gauge(P + "batch_lines_stored", "Stored batch lines (requests and results), "
                                        "all batches.", registry=r)
        r.register(_EngineCollector(stats, model_name, per_model))

    def observe_request(self, m: RequestMetrics | None, finish_reason: str | None, *,
                        gateway_wait_s: float = 0.0, model: str | None = None) -> None:
        """Record one finished engine request (call once per request that produced a token)."""
        if m is None or m.first_token_time is None:
            return
        name = model or self.model_name()
        self.ttft.labels(name).observe(max(0.0, m.first_token_time - m.arrival_time))
        for a, b in zip(m.token_times, m.token_times[1:]):
            self.itl.labels(name).observe(max(0.0, b - a))
        end = m.finished_time or m.last_token_time or m.first_token_time
        self.e2e.labels(name).observe(max(0.0, end - m.arrival_time))
        if m.first_scheduled_time is not None:
            self.queue.labels(name).observe(max(0.0, m.first_scheduled_time - m.arrival_time) + gateway_wait_s)
        self.success.labels(name, finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
