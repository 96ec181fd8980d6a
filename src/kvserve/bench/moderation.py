"""Moderation's cost, A/B in one server: `python -m kvserve.bench.moderation [--rounds 12]`.

Starts `kvserve serve` (the default model) with two keys: `on` (the default moderation: input and
output; PII redaction is off by default) and `off` (a policy with moderation off). Requests alternate on, off, on,
... with the same prompt, one at a time, streamed, ignoring EOS for a fixed output length, so both
arms see the same machine load. Prints each arm's TTFT p50 (client side: the first token's event;
and the first visible text, which PII redaction may hold back by up to a word) and decode
tokens/s (tokens after the first / time after the first), and the checks' own CPU time per call
(`time.process_time`, single thread) for an input prompt and an output window. An arm whose
answers output moderation cut (a false positive on the benign prompt: it happened, cutting every
"on" answer at 16 tokens) is said so: its numbers then compare different work.

`--pii` skips the server: CPU time of PII detection on hostile texts (issue 49, findings 2 and 6):
the stream redactor fed 4 characters at a time with 2k/4k/8k characters of a growing `sk-` key,
e-mail-ish text (`a.a.a.`), `a@a@` and digit groups; and `pii.find` over 40 KB and 1 MB of them.

`--input-only` skips the server: the input gate's wall time (ModerationService.check_input on a
chat request, the classifier and rules, as the server runs it) for a benign message of `--chars`
characters, p50 and p90 over `--runs` calls (issue 48's bound: under 5 ms p50 for 2,000 characters).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT = ("I am planning a weekend trip to the mountains with two friends. We like hiking, local food and "
          "quiet places. Could you suggest a plan for Saturday and Sunday, with a short list of what to pack "
          "and a few tips for staying safe on the trails? Please keep it practical.")


def _check_cpu_ms(n: int = 200) -> tuple[float, float]:
    from kvserve.safety import Moderator

    mod = Moderator()
    window = (PROMPT + " ") * 2
    out = []
    for text in (PROMPT, window[:400]):
        mod.check(text)
        t0 = time.process_time()
        for _ in range(n):
            mod.check(text)
        out.append((time.process_time() - t0) / n * 1000)
    return out[0], out[1]


def _stage_cpu_us_per_token(n_tokens: int = 512) -> float:
    """CPU time of the output stage (PII redaction + a window check every 16 tokens) per token."""
    import tempfile as _tf

    from kvserve.safety import ModerationConfig
    from kvserve.server.gates.moderation import ModerationService
    from kvserve.server.stages import ChoiceDelta

    service = ModerationService(ModerationConfig(), os.path.join(_tf.mkdtemp(), "kvserve.db"))
    words = (PROMPT + " Call 020 7946 0958 or write to a.b@example.com for 12 tickets. ").split()
    stage = service.output_stage(service.config)
    t0 = time.process_time()
    for i in range(n_tokens):
        stage.feed(ChoiceDelta(0, words[i % len(words)] + " ", [i], finish_reason="length" if i == n_tokens - 1
                               else None))
    service.close()
    return (time.process_time() - t0) / n_tokens * 1e6


HOSTILE = {"sk-run": lambda n: "sk-" + "a" * n, "email-ish": lambda n: "a." * (n // 2),
           "at-signs": lambda n: "a@" * (n // 2), "digit-groups": lambda n: "1 " * (n // 2),
           "a-run": lambda n: "a" * n}


def pii_cost(sizes: tuple[int, ...] = (2000, 4000, 8000), scans: tuple[int, ...] = (40_000, 1_000_000)) -> None:
    """Print the CPU milliseconds of streaming redaction and of one scan over hostile texts."""
    from kvserve.safety import pii

    for n in sizes:
        cells = []
        for name, make in HOSTILE.items():
            text, r = make(n), pii.StreamRedactor()
            c0 = time.thread_time()
            for i in range(0, len(text), 4):
                r.feed(text[i:i + 4])
            r.finish()
            cells.append(f"{name} {(time.thread_time() - c0) * 1000:.0f} ms")
        print(f"stream redaction, {n} characters: " + ", ".join(cells))
    for n in scans:
        cells = []
        for name, make in HOSTILE.items():
            text = make(n)
            c0 = time.thread_time()
            pii.find(text)
            cells.append(f"{name} {(time.thread_time() - c0) * 1000:.0f} ms")
        print(f"find, {n} characters: " + ", ".join(cells))


def input_gate_ms(chars: int = 2000, runs: int = 300) -> tuple[float, float, float]:
    """(p50, p90, CPU p50) milliseconds of the input gate on one `chars`-character user message:
    wall time, and CPU time of this thread (less sensitive to other load on the machine)."""
    import tempfile as _tf

    from kvserve.safety import ModerationConfig
    from kvserve.server.gates.moderation import ModerationService
    from kvserve.server.protocol import ChatCompletionRequest
    from kvserve.server.records import RequestRecord

    text = ((PROMPT + " ") * (chars // len(PROMPT) + 1))[:chars]
    service = ModerationService(ModerationConfig(), os.path.join(_tf.mkdtemp(), "kvserve.db"))
    req = ChatCompletionRequest(messages=[{"role": "user", "content": text}])
    times, cpu = [], []
    for i in range(runs + 10):
        record = RequestRecord(request_id=str(i), t0=0.0, method="POST", path="/v1/chat/completions")
        t0, c0 = time.perf_counter(), time.thread_time()
        service.check_input(req, record, service.config)
        if i >= 10:                 # the first calls load the model
            times.append((time.perf_counter() - t0) * 1000)
            cpu.append((time.thread_time() - c0) * 1000)
    service.close()
    times.sort()
    return statistics.median(times), times[int(0.9 * len(times))], statistics.median(cpu)


def _one(base: str, key: str, max_tokens: int) -> tuple[float, float, float, str | None]:
    import httpx

    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "cache": False}   # the same prompt every time: the semantic cache would answer it
    t0 = time.perf_counter()
    first = first_event = finish = None
    tokens = 0
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                continue
            deltas = [c.get("delta", {}) for c in chunk["choices"]]
            finish = next((c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")), finish)
            if first_event is None and deltas and not any("role" in d for d in deltas):
                first_event = time.perf_counter()       # the first token's event (its text may be held back)
            if first is None and any(d.get("content") for d in deltas):
                first = time.perf_counter()             # the first visible text
    end = time.perf_counter()
    first, first_event = first or end, first_event or end
    return ((first_event - t0) * 1000, (tokens - 1) / (end - first_event) if end > first_event else 0.0,
            (first - t0) * 1000, finish)


def main(argv: list[str] | None = None) -> None:
    import argparse

    from kvserve.bench.common import wait_healthy
    from kvserve.bench.serve_launch import free_port
    from kvserve.server.stores.keys import KeyStore
    from kvserve.server.stores.moderation_policies import PolicyStore

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--input-only", action="store_true", help="Only time the input gate (no server).")
    ap.add_argument("--pii", action="store_true", help="Only time PII detection on hostile texts (no server).")
    ap.add_argument("--chars", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=300)
    args = ap.parse_args(argv)
    if args.pii:
        pii_cost()
        return
    if args.input_only:
        p50, p90, cpu = input_gate_ms(args.chars, args.runs)
        print(f"input moderation, {args.chars}-character message: p50 {p50:.2f} ms, p90 {p90:.2f} ms, "
              f"CPU p50 {cpu:.2f} ms ({args.runs} calls)")
        return
    in_ms, win_ms = _check_cpu_ms()
    print(f"check CPU time: input prompt ({len(PROMPT)} chars) {in_ms:.3f} ms, output window (400 chars) "
          f"{win_ms:.3f} ms; output stage {_stage_cpu_us_per_token():.1f} us of CPU per token")
    data = tempfile.mkdtemp(prefix="kvserve-bench-moderation-")
    store = KeyStore(os.path.join(data, "kvserve.db"))
    keys = {"on": store.create("on"), "off": store.create("off")}
    store.close()
    policies = PolicyStore(os.path.join(data, "kvserve.db"))
    policies.set("off", {"mode": "off", "pii_output": "off", "pii_input": "off"})
    policies.close()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.server", "serve", "--port", str(port), "--data-dir", data],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base)
        for arm in ("on", "off"):      # warm up
            _one(base, keys[arm], 8)
        results: dict[str, list[tuple[float, float, float, str | None]]] = {"on": [], "off": []}
        for i in range(args.rounds):
            for arm in (("on", "off") if i % 2 == 0 else ("off", "on")):
                results[arm].append(_one(base, keys[arm], args.max_tokens))
        for arm, rows in results.items():
            ttft = statistics.median(r[0] for r in rows)
            tps = statistics.median(r[1] for r in rows)
            text = statistics.median(r[2] for r in rows)
            cut = sum(1 for r in rows if r[3] == "content_filter")
            print(f"moderation {arm:>3}: TTFT p50 {ttft:.1f} ms (first visible text {text:.1f} ms), decode "
                  f"{tps:.2f} tok/s (median of {len(rows)})" + (f"; {cut} answers CUT by output moderation: "
                                                               "decode and TTFT are not comparable" if cut else ""))
        d_ttft = statistics.median(r[0] for r in results["on"]) - statistics.median(r[0] for r in results["off"])
        d_tps = 1 - statistics.median(r[1] for r in results["on"]) / statistics.median(r[1] for r in results["off"])
        print(f"added TTFT p50: {d_ttft:+.1f} ms; decode tok/s lower by {d_tps * 100:+.1f}%")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
