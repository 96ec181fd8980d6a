"""Per-pool latency of a disaggregated kvserve server (`serve --prefill-replicas P
--decode-replicas D`), read from its /metrics (`kvserve:pool_*_total{pool=...}`) before and after
the load: the prefill pool's time to first token (the prompt on a prefill replica), the decode
pool's time to first token from the KV hand-over, and its inter-token latency."""

from __future__ import annotations

from kvserve.bench.common import metric_families

_NAMES = {"kvserve:pool_requests": "requests", "kvserve:pool_ttft_seconds": "ttft_s",
          "kvserve:pool_itl_seconds": "itl_s", "kvserve:pool_itl_tokens": "itl_tokens"}


def fetch_pools(base_url: str, api_key: str | None = None) -> dict[str, dict[str, float]] | None:
    """{pool: {requests, ttft_s, itl_s, itl_tokens}} (cumulative), or None without pools."""
    families = metric_families(base_url, api_key)
    if families is None:
        return None
    out: dict[str, dict[str, float]] = {}
    for fam in families:
        if fam.name in _NAMES:
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out.setdefault(s.labels["pool"], {})[_NAMES[fam.name]] = s.value
    return out or None


def pools_delta(before: dict, after: dict) -> dict[str, dict[str, float | None]]:
    """Mean TTFT and ITL in ms per pool over the load."""
    out = {}
    for pool, a in after.items():
        b = before.get(pool, {})
        d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in _NAMES.values()}
        out[pool] = {"requests": int(d["requests"]),
                     "mean_ttft_ms": 1000 * d["ttft_s"] / d["requests"] if d["requests"] else None,
                     "mean_itl_ms": 1000 * d["itl_s"] / d["itl_tokens"] if d["itl_tokens"] else None}
    return out


def pools_line(label: str, pools: dict) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f} ms"

    parts = [f"{pool}: {p['requests']} requests, mean TTFT {ms(p['mean_ttft_ms'])}"
             + (f", mean ITL {ms(p['mean_itl_ms'])}" if p["mean_itl_ms"] is not None else "")
             for pool, p in sorted(pools.items(), key=lambda kv: kv[0] != "prefill")]
    return f"{label} per pool: " + "; ".join(parts)
