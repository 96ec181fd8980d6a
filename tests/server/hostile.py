"""Hostile requests of issue 49 (valid and small on the wire, dear for the server) and the
bystander probe that checks one of them does not stall everyone else.

`HOSTILE` is the soak's mix (test_soak_hostile.py): one entry per kind, `(name, send)` where
`send(client, base_url, headers)` makes the request and returns its response; a kind found later
is one more entry here (or in `SLOW_KINDS`, checked against a bystander but not soaked). `bystander_ms` is what a well-behaved caller sees: the median of several
probes (a two-token chat, /health), so one noisy sample on a shared machine does not decide.

`bystander_check` is the issue's bound for one kind: the bystander unloaded (before and after;
the slower of the two, as a shared machine drifts both ways within minutes), then while the kind
is sent back to back (at most 20 a second) from its own process (`python hostile.py KIND URL`:
building megabyte bodies never takes the probing process's GIL), as a ratio, never as an absolute
time.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

PROBE_QUESTIONS = [
    "What is the capital of France?", "Name a primary colour.", "How many legs does a spider have?",
    "What gas do plants absorb?", "Which planet is called the red planet?", "What is frozen water called?",
    "Who wrote Hamlet?", "What is the boiling point of water in Celsius?", "What do bees make?",
    "How many days are in a week?", "What is the largest ocean?", "Which animal says moo?",
    "What colour is the sky on a clear day?", "What is two plus two?", "Which metal is liquid at room temperature?",
    "What language is spoken in Brazil?", "How many continents are there?", "What is the opposite of hot?",
    "Which organ pumps blood?", "What shape has three sides?", "What is the chemical symbol of gold?",
    "Which season follows winter?", "What do you call a baby cat?", "What is the tallest animal?",
]


def long_text(i: int, words: int = 249) -> str:
    """About 250 tokens in 500 bytes (a letter is a token): 2,048 of them fit the 1 MB body cap,
    as in the issue's 2,048 x 256-token request."""
    return " ".join("abcdefghijklmnopqrstuvwxyz"[(i * 7 + j * 3) % 26] for j in range(words))


def chat_probe(base_url: str, headers: dict, question: str) -> float:
    """Seconds for a two-token chat (raises on a non-200)."""
    t0 = time.perf_counter()
    r = httpx.post(base_url + "/v1/chat/completions", headers=headers, timeout=300,
                   json={"messages": [{"role": "user", "content": question}], "max_tokens": 2, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0


def health_probe(base_url: str) -> float:
    t0 = time.perf_counter()
    httpx.get(base_url + "/health", timeout=300).raise_for_status()
    return time.perf_counter() - t0


def bystander_ms(base_url: str, headers: dict, questions: list[str]) -> tuple[float, float]:
    """(median chat ms, median /health ms) over one probe per question."""
    chats, healths = [], []
    for q in questions:
        chats.append(chat_probe(base_url, headers, q))
        healths.append(health_probe(base_url))
        time.sleep(0.05)
    return statistics.median(chats) * 1000, statistics.median(healths) * 1000


def within(loaded_ms: float, base_ms: float, factor: float = 2.0, slack_ms: float = 50.0) -> bool:
    """The issue's bound: a bystander within `factor` times its unloaded latency (plus a few ms of
    slack for the scheduling noise of a shared machine at sub-10 ms baselines)."""
    return loaded_ms <= factor * base_ms + slack_ms


# ---- the hostile kinds ------------------------------------------------------------------------

def big_embeddings(client: httpx.Client, base_url: str, headers: dict, inputs: int = 200,
                   timeout: float = 600) -> httpx.Response:
    """The largest /v1/embeddings request the caps allow (about 200 x 256 tokens); with a short
    `timeout`, sent by a client that hangs up (httpx.TimeoutException; the server stops: 499)."""
    return client.post(base_url + "/v1/embeddings", headers=headers, timeout=timeout,
                       json={"input": [long_text(i) for i in range(inputs)]})


def oversized_embeddings(client: httpx.Client, base_url: str, headers: dict) -> httpx.Response:
    """Issue 49's 2,048 x 256 tokens: past the token cap (400)."""
    return client.post(base_url + "/v1/embeddings", headers=headers, timeout=600,
                       json={"input": [long_text(i) for i in range(2048)]})


def big_metadata_response(client: httpx.Client, base_url: str, headers: dict) -> httpx.Response:
    """A stored response with a 1 MB metadata value (400: metadata.x longer than 512)."""
    return client.post(base_url + "/v1/responses", headers=headers, timeout=600,
                       json={"input": "hi", "max_output_tokens": 1, "metadata": {"x": "v" * 1_000_000}})


def stored_responses(client: httpx.Client, base_url: str, headers: dict) -> httpx.Response:
    """Stored responses until the owner's quota refuses them (then 429 `quota_exceeded`)."""
    return client.post(base_url + "/v1/responses", headers=headers, timeout=600,
                       json={"input": "hi", "max_output_tokens": 1, "metadata": {"k": "v" * 500}})


def arena_battles(client: httpx.Client, base_url: str, headers: dict) -> httpx.Response:
    """Battles until the owner's quota refuses them, and a vote before any answer (409)."""
    r = client.post(base_url + "/v1/kvserve/arena/battles", headers=headers, timeout=600,
                    json={"prompt": "p" * 7000})
    if r.status_code == 200:
        client.post(base_url + f"/v1/kvserve/arena/battles/{r.json()['id']}/vote", headers=headers, timeout=600,
                    json={"winner": "a"})
    return r


def guessed_admin_key(client: httpx.Client, base_url: str, headers: dict) -> httpx.Response:
    """Admin-key guesses at line rate (throttled: 429 after a few)."""
    return client.post(base_url + "/v1/load_lora_adapter", headers={"Authorization": "Bearer guess"},
                       timeout=600, json={"lora_name": "x", "lora_path": "/nonexistent"})


def newline_path(client: httpx.Client, base_url: str, headers: dict) -> httpx.Response:
    """A path with an encoded newline (a 404, logged escaped)."""
    return client.get(base_url + "/v1/%0a{\"forged\":1}", headers=headers, timeout=600)


def _chat(client: httpx.Client, base_url: str, headers: dict, **body) -> httpx.Response:
    body.setdefault("messages", [{"role": "user", "content": "Tell me about the sea."}])
    return client.post(base_url + "/v1/chat/completions", headers=headers, timeout=600,
                       json={"max_tokens": 32, "temperature": 0, "cache": False, **body})


def long_stops(client: httpx.Client, base_url: str, headers: dict) -> httpx.Response:
    """Sixteen stops of the largest length allowed, n=4 (49.1: an automaton, not a rescan; completes)."""
    return _chat(client, base_url, headers, n=4, temperature=0.8,
                 stop=[chr(97 + i) * 1000 + " sea" for i in range(16)])


def huge_stops(client: httpx.Client, base_url: str, headers: dict) -> httpx.Response:
    """Issue 49's sixteen 60 KB stops (400 naming `stop`)."""
    return _chat(client, base_url, headers, stop=["s" * 60_000 + str(i) for i in range(16)])


def wide_logit_bias(client: httpx.Client, base_url: str, headers: dict) -> httpx.Response:
    """The most logit_bias entries allowed at n=4 (49.7: one dense row per request; completes), and a
    vocabulary-wide map (400 naming `logit_bias`)."""
    _chat(client, base_url, headers, logit_bias={str(t): -1 for t in range(49_000)})
    return _chat(client, base_url, headers, n=4, temperature=0.8, logit_bias={str(t): 0.5 for t in range(300)})


def huge_choice_grammar(client: httpx.Client, base_url: str, headers: dict) -> httpx.Response:
    """A grammar past its size cap (49.8: 400 before llguidance sees it)."""
    return _chat(client, base_url, headers, guided_choice=[f"option number {i}" for i in range(40_000)])


def secret_shaped_output(client: httpx.Client, base_url: str, headers: dict) -> httpx.Response:
    """A grammar that forces a growing secret-shaped answer (49.2: bounded redaction; completes)."""
    return _chat(client, base_url, headers, guided_regex="sk-[a-z]+", max_tokens=256)


def truncate_many_turns(client: httpx.Client, base_url: str, headers: dict) -> httpx.Response:
    """256 turns that must mostly be dropped to fit (49.8: bisected, not one render per drop)."""
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": long_text(i, 60)} for i in range(255)]
    return _chat(client, base_url, headers, messages=turns, truncate="oldest", max_tokens=4)


def pii_heavy_input(client: httpx.Client, base_url: str, headers: dict) -> httpx.Response:
    """Half a megabyte of e-mail-like text (49.6: linear scans; a 400 for the context, not minutes)."""
    text = " ".join(f"user{i}.name@mail{i % 97}.example.com a.b.c.d@" for i in range(12_000))
    return _chat(client, base_url, headers, messages=[{"role": "user", "content": text}], max_tokens=1)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def long_tool_call(client: httpx.Client, base_url: str, headers: dict) -> httpx.Response:
    """A tool-call block held open for 256 tokens, tags and all inside its string (49.8: the
    parser resumes its scan, not one rescan of the block per token; completes)."""
    return _chat(client, base_url, headers, tools=[WEATHER_TOOL], max_tokens=256, ignore_eos=True,
                 messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                 guided_regex='<tool_call>\n\\{"name": "get_weather", "arguments": \\{"city": "[a-z<>/ ]+')


def growing_secret_output(client: httpx.Client, base_url: str, headers: dict) -> httpx.Response:
    """`sk-sk-sk-...` for 128 tokens without a grammar (a logit_bias on the tokens of "sk" and "-"),
    redacted (49.2: a bounded hold-back, masked once; completes)."""
    ids = client.post(base_url + "/tokenize", headers=headers, timeout=600, json={"prompt": "sk-"}).json()["tokens"]
    return client.post(base_url + "/v1/completions", headers=headers, timeout=600, json={
        "prompt": "The key is sk-", "max_tokens": 128, "temperature": 0, "ignore_eos": True, "cache": False,
        "logit_bias": {str(i): 100 for i in ids}, "kvserve_moderation": {"pii_output": "redact"}})


# ---- issue 60: uploads and batches (the files engineer's kinds; keep_alive/load kinds are separate) ----

_BOUNDARY = "hostileboundary60"


def _form(file: bytes, purpose: str = "batch") -> bytes:
    return (f"--{_BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n{purpose}\r\n"
            f"--{_BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n\r\n"
            ).encode() + file + f"\r\n--{_BOUNDARY}--\r\n".encode()


def _upload(client: httpx.Client, base_url: str, headers: dict, body: bytes) -> httpx.Response:
    return client.post(base_url + "/v1/files", content=body, timeout=600,
                       headers={**headers, "content-type": f"multipart/form-data; boundary={_BOUNDARY}"})


_MANY_PARTS = f"--{_BOUNDARY}\r\n\r\n\r\n".encode() * 200_000 + f"--{_BOUNDARY}--\r\n".encode()


def many_parts_upload(client: httpx.Client, base_url: str, headers: dict) -> httpx.Response:
    """200,000 empty multipart parts, 5.8 MB (issue 60: refused at the part cap, not parsed; 400)."""
    return _upload(client, base_url, headers, _MANY_PARTS)


def bad_batch_lines(client: httpx.Client, base_url: str, headers: dict) -> httpx.Response:
    """A batch file whose line holds a lone surrogate, then one nested 50,000 deep (issue 60: each
    a 400 naming the line, as the interactive route answers the same body; never a 500)."""
    head = '{"custom_id": "r0", "method": "POST", "url": "/v1/chat/completions", "body": '
    _upload(client, base_url, headers, _form((head + '{"messages": [{"role": "user", "content": "\\ud800"}]}}\n')
                                             .encode()))
    return _upload(client, base_url, headers, _form((head + "[" * 50_000 + "]" * 50_000 + "}\n").encode()))


def upload_and_batch(client: httpx.Client, base_url: str, headers: dict) -> httpx.Response:
    """A 20-line batch file uploaded and a batch made of it, again and again (issue 60: the key's
    quotas refuse them, 413/429, and the runner's lines stay below interactive requests)."""
    lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 2}})
                    + "\n" for i in range(20))
    r = _upload(client, base_url, headers, _form(lines.encode()))
    if r.status_code != 200:
        return r
    return client.post(base_url + "/v1/batches", headers=headers, timeout=600,
                       json={"input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions",
                             "completion_window": "24h"})


UPLOAD_KINDS = [("many_parts_upload", many_parts_upload), ("bad_batch_lines", bad_batch_lines),
                ("upload_and_batch", upload_and_batch)]

Send = Callable[[httpx.Client, str, dict], httpx.Response]

HOSTILE: list[tuple[str, Send]] = [
    ("big_embeddings", big_embeddings),
    ("oversized_embeddings", oversized_embeddings),
    ("big_metadata_response", big_metadata_response),
    ("stored_responses", stored_responses),
    ("arena_battles", arena_battles),
    ("guessed_admin_key", guessed_admin_key),
    ("newline_path", newline_path),
    ("long_stops", long_stops),
    ("huge_stops", huge_stops),
    ("wide_logit_bias", wide_logit_bias),
    ("huge_choice_grammar", huge_choice_grammar),
    ("secret_shaped_output", secret_shaped_output),
    ("truncate_many_turns", truncate_many_turns),
    ("pii_heavy_input", pii_heavy_input),
    *UPLOAD_KINDS,
]

# ---- issue 60: keep_alive abuse and models on demand (their own block: other kinds are added above) ----

ON_DEMAND_MODEL = "ondemand-probe"    # a model of the server's --models-dir when it has one; else a 404


def keep_alive_abuse(client: httpx.Client, base_url: str, headers: dict) -> httpx.Response:
    """keep_alive NaN, infinity and 1e12 (60: afterwards /api/ps answered 500 to everyone), 0 on the
    server's own model (60: any key could unload a shared model); returns /api/ps, which must stay 200."""
    model = client.get(base_url + "/v1/models", headers=headers, timeout=60).json()["data"][0]["id"]
    for raw in ("NaN", "Infinity", "1e12", "-1", "0"):
        client.post(base_url + "/api/generate", headers=headers | {"content-type": "application/json"},
                    timeout=600, content=f'{{"model": "{model}", "keep_alive": {raw}}}')
    client.post(base_url + "/api/chat", headers=headers, timeout=600, json={
        "model": model, "keep_alive": "1e12h", "stream": False, "options": {"num_predict": 1},
        "messages": [{"role": "user", "content": "hi"}]})
    return client.get(base_url + "/api/ps", headers=headers, timeout=600)


def on_demand_loads(client: httpx.Client, base_url: str, headers: dict) -> httpx.Response:
    """Requests that would load a model on demand for free or for nothing (60): refused ones (tpm,
    caps), lookups (/tokenize, count_tokens), unknown names (a --models-dir rescan each)."""
    chat = {"model": ON_DEMAND_MODEL, "messages": [{"role": "user", "content": "hi"}]}
    client.post(base_url + "/v1/chat/completions", headers=headers, timeout=600, json=chat | {"temperature": 50})
    client.post(base_url + "/tokenize", headers=headers, timeout=600, json={"model": ON_DEMAND_MODEL, "prompt": "hi"})
    client.post(base_url + "/v1/messages/count_tokens", headers=headers, timeout=600, json=chat)
    client.post(base_url + "/v1/chat/completions", headers=headers, timeout=600,
                json=chat | {"model": f"no-such-model-{time.monotonic_ns()}", "max_tokens": 1})
    return client.post(base_url + "/v1/chat/completions", headers=headers, timeout=600,
                       json=chat | {"max_tokens": 100_000})


ON_DEMAND_KINDS: list[tuple[str, Send]] = [
    ("keep_alive_abuse", keep_alive_abuse),
    ("on_demand_loads", on_demand_loads),
]
HOSTILE += ON_DEMAND_KINDS

# Kinds the bystander check sends but the soak's mix does not (yet): each takes seconds of decoding,
# and the short soak must send every kind of its mix within 30 s.
SLOW_KINDS: list[tuple[str, Send]] = [
    ("long_tool_call", long_tool_call),
    ("growing_secret_output", growing_secret_output),
]
ALL_KINDS = HOSTILE + SLOW_KINDS


# ---- one kind against a bystander ----------------------------------------------------------------

@dataclass
class Check:
    """One kind's bystander numbers (medians, ms) and the statuses its requests got."""

    name: str
    before: tuple[float, float]
    loaded: tuple[float, float]
    after: tuple[float, float]
    statuses: list[str] = field(default_factory=list)

    @property
    def base(self) -> tuple[float, float]:
        return max(self.before[0], self.after[0]), max(self.before[1], self.after[1])

    def ok(self) -> bool:
        """Chat and /health each within 2x of their unloaded median."""
        return all(within(loaded, base) for loaded, base in zip(self.loaded, self.base, strict=True))

    def __str__(self) -> str:
        (b0, b1), (l0, l1), (a0, a1) = self.before, self.loaded, self.after
        return (f"{self.name}: chat {b0:.0f} -> {l0:.0f} -> {a0:.0f} ms ({l0 / self.base[0]:.2f}x), "
                f"health {b1:.1f} -> {l1:.1f} -> {a1:.1f} ms ({l1 / self.base[1]:.2f}x), "
                f"{len(self.statuses)} sent: {sorted(set(self.statuses))}")


MIN_INTERVAL_S = 0.05   # a loop starts at most 20 requests a second: the cost of each request is
                        # checked here; a flood at line rate is the rate limiter's (test_hardening.py)


class Sender:
    """`clients` loops sending one kind back to back (at most one each `MIN_INTERVAL_S`) from a
    process of their own, until stopped; `stop()` returns each answer's status (or "timeout" / the
    exception's name)."""

    def __init__(self, name: str, base_url: str, headers: dict, clients: int = 1):
        self.proc = subprocess.Popen([sys.executable, __file__, name, base_url, json.dumps(headers), str(clients)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def stop(self) -> list[str]:
        out, _ = self.proc.communicate("", timeout=900)   # stdin closed: finish the requests in flight
        return out.split()


def bystander_check(base_url: str, headers: dict, name: str, questions: list[str], *, clients: int = 1,
                    settle_s: float = 1.0, before: tuple[float, float] | None = None) -> Check:
    """The bystander before, while `name` is sent back to back (after `settle_s`, so a request is
    in flight), and after; the caller warms the server up first (probes and the kind once). A
    caller checking several kinds in a row may pass the previous check's `after` as `before`: both
    are the unloaded bystander on the same server, and the probes are a third of a check's time."""
    if before is None:
        before = bystander_ms(base_url, headers, questions)
    sender = Sender(name, base_url, headers, clients)
    try:
        time.sleep(settle_s)
        loaded = bystander_ms(base_url, headers, questions)
    finally:
        statuses = sender.stop()
    return Check(name, before, loaded, bystander_ms(base_url, headers, questions), statuses)


def _send_until_stdin_closes(name: str, base_url: str, headers: dict, clients: int) -> None:
    send, stop, lock = dict(ALL_KINDS)[name], threading.Event(), threading.Lock()
    statuses: list[str] = []

    def loop() -> None:
        with httpx.Client() as c:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    status = str(send(c, base_url, headers).status_code)
                except httpx.TimeoutException:
                    status = "timeout"
                except httpx.HTTPError as e:
                    status = type(e).__name__
                with lock:
                    statuses.append(status)
                stop.wait(MIN_INTERVAL_S - (time.monotonic() - started))

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    sys.stdin.read()
    stop.set()
    for t in threads:
        t.join()
    print(" ".join(statuses))


if __name__ == "__main__":
    _send_until_stdin_closes(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]))
