"""The semantic cache: answer a chat request from a stored answer to the same question, asked
with other words.

A request's key has two parts. The *exact* part must match byte for byte: the model (an adapter
is its own model name), who may see the answer (`scope`: the key's name unless `shared` is set,
the end `user`, and always the request's `cache_salt` and the caller's moderation policy: the
partitions are at least as fine as the prefix cache's, cache_scope.py), every request field that
can change the answer (temperature, top_p, max_tokens, seed, stop, response_format, ...), the
system prompt and every message before the last, the last message's *context* (semantic_text.
split_query: every paragraph but its short final question, so a long shared document or code
cannot make two questions about it look alike) and the facts of its question (semantic_text.facts:
numbers, operators, names, negation, units). Its hash is the entry's *partition*; a lookup only
ever sees its own partition's entries, so a trace's `matched_query` is never another caller's.
The *semantic* part is the embedding of the question, normalized, through the cache's
embedding head (`CacheHead`; train/cache_head.py trains it, server/data/cache_head.npz is the
default, its digest is in the exact part): within the partition, the nearest stored query hits when
its cosine is >= `threshold` (a lower `arithmetic_threshold` when the facts alone are the whole
question, e.g. "6 times 7" vs "what's 6 multiplied by 7"). The head maps MiniLM's vectors to ones
where paraphrases sit at cosine >= 0.95; with `head` "none" the raw MiniLM cosine wants ~0.85.

Completions (/v1/completions) follow the same rules with the prompt as the last user message and
no history, in their own partitions (the kind is in the exact part); a prompt that is not one
string, `echo` and `suffix` bypass.

Never cached (counted as bypasses): `"cache": false`, requests with tools, n > 1 or logprobs,
temperature above `max_temperature`, creative prompts (semantic_text.is_creative), a last message
that is not the user's. Only answers that finished normally (stop or length, no tool calls) are
stored. Entries expire after `ttl_s` and the least recently used go past `max_entries`.

A match is a *candidate*, not an answer: with `verify` (the default) the request runs on the
engine like a miss, with the stored answer's tokens as its draft (EngineCoreRequest.
draft_token_ids). The engine verifies them as it verifies speculative drafts, in one forward after
the prompt's prefill: a greedy request keeps the longest prefix that is exactly its own greedy
continuation (so a hit is token for token what a miss gives) and decodes on from there; a sampled
request keeps the stored tokens while each is likely enough under the model (raw logprob >=
`sampled_min_logprob`, and drawable by its own sampling), then decodes on; with
`sampled_min_logprob` None it goes through the exact rejection rule instead (each token kept with
the model's probability of it: distributed exactly as a miss's answer, rarely kept whole). The
default threshold is calibrated on held-out pairs (bench/semantic_heldout.calibrate,
docs/routing.md). A seeded sampled request takes no draft (its tokens must not depend on the cache). `verify: false` serves the stored text without
the model (the previous behaviour: a wrong hit is a wrong answer).

Storage is a `CacheBackend`: the default keeps entries in SQLite on disk (semantic_cache.db in
the data directory, 0600) with an in-memory mirror of the recently used partitions' vectors (LRU,
each partition counted as at least one entry against `max_entries`); because the exact part
partitions the space, a lookup scans only the handful of vectors that share its partition.
With --redis-url, stores/redis_cache.RedisCacheBackend implements the same four methods in Redis, so
every replica shares the answers (step.py picks the backend).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import pathlib
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Protocol

import numpy as np

from kvserve.errors import InvalidRequest
from kvserve.semantic_text import facts, is_creative, normalize, split_query
from kvserve.server.routing.cache_head import HEAD_PATH, CacheHead, load_head  # noqa: F401 - re-exported
from kvserve.server.stores import sqlite_file

# Request fields that never change the answer's text (everything else is in the exact part).
NEUTRAL_FIELDS = {"messages", "prompt", "model", "stream", "stream_options", "user", "store", "metadata", "service_tier",
                  "kvserve_trace", "priority", "cache", "cache_salt"}


@dataclass
class CacheOptions:
    threshold: float = 0.95
    arithmetic_threshold: float = 0.6
    max_temperature: float = 1.0
    ttl_s: float = 24 * 3600.0
    max_entries: int = 10_000
    shared: bool = False            # share answers across API keys
    head: str = "default"           # the embedding head: "default", "none" (raw MiniLM), or an npz path
    verify: bool = True             # the model checks a candidate answer before it is served (docstring)
    sampled_min_logprob: float | None = -3.0   # sampled requests: keep stored tokens by likelihood (docstring)

    @classmethod
    def from_dict(cls, d: dict) -> CacheOptions:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidRequest(f"semantic_cache: unknown option(s) {sorted(unknown)}", param="semantic_cache")
        lp = d.get("sampled_min_logprob", cls.sampled_min_logprob)
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int | float) or not lp <= 0):
            raise InvalidRequest("semantic_cache: sampled_min_logprob must be a logprob (a number <= 0) or null",
                                 param="semantic_cache")
        return cls(**{**d, "sampled_min_logprob": None if lp is None else float(lp)})


@dataclass
class Entry:
    id: str
    partition: str
    query: str
    vector: np.ndarray
    answer: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    created: float
    last_used: float
    token_ids: list[int] | None = None    # the answer's token ids (the verification's draft)


class CacheBackend(Protocol):
    def nearest(self, partition: str, vector: np.ndarray, now: float, max_age_s: float) -> tuple[Entry, float] | None:
        """The closest live entry of the partition and its cosine, or None."""

    def put(self, entry: Entry, max_entries: int) -> None:
        """Store an entry, evicting the least recently used past `max_entries`."""

    def touch(self, entry: Entry, now: float) -> None: ...

    def close(self) -> None: ...


_COLUMNS = ("id, partition, query, vector, answer, finish_reason, prompt_tokens, completion_tokens, created, "
            "last_used, token_ids")


class SQLiteBackend:
    """Entries in SQLite; the recently used partitions' vectors mirrored in memory (LRU, at most
    `mirror_entries` entries, an empty partition counted as one)."""

    def __init__(self, path: pathlib.Path, mirror_entries: int = 10_000):
        self.db = sqlite_file.connect(path, check_same_thread=False)
        self.db.execute("CREATE TABLE IF NOT EXISTS semantic_cache (id TEXT PRIMARY KEY, partition TEXT, query TEXT, "
                        "vector BLOB, answer TEXT, finish_reason TEXT, prompt_tokens INT, completion_tokens INT, "
                        "created REAL, last_used REAL)")
        if "token_ids" not in {r[1] for r in self.db.execute("PRAGMA table_info(semantic_cache)")}:
            self.db.execute("ALTER TABLE semantic_cache ADD COLUMN token_ids TEXT")
        self.db.execute("CREATE INDEX IF NOT EXISTS semantic_cache_partition ON semantic_cache(partition)")
        self.db.execute("CREATE INDEX IF NOT EXISTS semantic_cache_lru ON semantic_cache(last_used)")
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.commit()
        self.lock = threading.Lock()
        self.mirror: OrderedDict[str, list[Entry]] = OrderedDict()
        self.mirror_entries = max(1, mirror_entries)
        self.mirrored = 0                      # sum of max(1, len(p)) over the mirror's partitions
        self.touched: dict[str, float] = {}    # hits' last_used times, written with the next put or close

    def _partition(self, partition: str) -> list[Entry]:
        got = self.mirror.get(partition)
        if got is not None:
            self.mirror.move_to_end(partition)
            return got
        rows = self.db.execute(f"SELECT {_COLUMNS} FROM semantic_cache WHERE partition = ?", (partition,)).fetchall()
        got = [Entry(r[0], r[1], r[2], np.frombuffer(r[3], dtype=np.float32), *r[4:10],
                     json.loads(r[10]) if r[10] else None) for r in rows]
        self.mirror[partition] = got
        self.mirrored += max(1, len(got))
        while self.mirrored > self.mirror_entries and len(self.mirror) > 1:   # drop the least recently used
            _, old = self.mirror.popitem(last=False)
            self.mirrored -= max(1, len(old))
        return got

    def _resize(self, partition: str, entries: list[Entry]) -> None:
        """Replace a mirrored partition's list, keeping the count."""
        old = self.mirror.get(partition)
        if old is not None:
            self.mirrored += max(1, len(entries)) - max(1, len(old))
            self.mirror[partition] = entries

    def nearest(self, partition, vector, now, max_age_s):
        with self.lock:
            live = [e for e in self._partition(partition) if now - e.created <= max_age_s]
            if not live:
                return None
            sims = np.stack([e.vector for e in live]) @ vector
            i = int(np.argmax(sims))
            return live[i], float(sims[i])

    def _flush_touched(self) -> None:
        if self.touched:
            self.db.executemany("UPDATE semantic_cache SET last_used = ? WHERE id = ?",
                                [(t, i) for i, t in self.touched.items()])
            self.touched.clear()

    def put(self, entry, max_entries):
        with self.lock:
            self._flush_touched()      # the LRU order below needs the hits' times
            self.db.execute(f"INSERT OR REPLACE INTO semantic_cache ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                            (entry.id, entry.partition, entry.query, entry.vector.astype(np.float32).tobytes(),
                             entry.answer, entry.finish_reason, entry.prompt_tokens, entry.completion_tokens,
                             entry.created, entry.last_used,
                             json.dumps(entry.token_ids) if entry.token_ids is not None else None))
            self._resize(entry.partition, self._partition(entry.partition) + [entry])
            (count,) = self.db.execute("SELECT COUNT(*) FROM semantic_cache").fetchone()
            if count > max_entries:
                old = self.db.execute("SELECT id, partition FROM semantic_cache ORDER BY last_used LIMIT ?",
                                      (count - max_entries,)).fetchall()
                self.db.executemany("DELETE FROM semantic_cache WHERE id = ?", [(i,) for i, _ in old])
                for i, p in old:
                    if p in self.mirror:
                        self._resize(p, [e for e in self.mirror[p] if e.id != i])
            self.db.commit()

    def touch(self, entry, now):
        """A hit: kept in memory (no disk write on the hit's path) until the next put or close."""
        with self.lock:
            entry.last_used = now
            self.touched[entry.id] = now

    def close(self) -> None:
        with self.lock:
            self._flush_touched()
            self.db.commit()
            self.db.close()


@dataclass
class CachePlan:
    """One request's cache key, made before generation; `vector` is filled by the lookup."""

    partition: str
    query: str
    vector: np.ndarray | None = None
    arithmetic: bool = False

    @property
    def text(self) -> str:
        """What is embedded: the normalized query."""
        return normalize(self.query)


@dataclass
class Hit:
    """A stored answer that matched: served as is (`verify` off) or offered to the model as a draft."""

    entry: Entry
    similarity: float
    lookup_ms: float = 0.0
    trace: dict = field(default_factory=dict)
    draft: list[int] | None = None      # the token ids offered to the engine (None: served without it)
    min_logprob: float | None = None    # a sampled request keeps them by likelihood (`sampled_min_logprob`)

    def trace_fields(self, now: float) -> dict:
        return {"matched_query": self.entry.query, "similarity": round(self.similarity, 4),
                "age_s": round(now - self.entry.created, 1), "lookup_ms": round(self.lookup_ms, 2)}

    def verification(self, token_ids: list[int], finish_reason: str | None) -> dict:
        """What the model did with the draft: "verified" (served whole: the answer is the stored
        one), "partial" (its first `accepted_tokens` kept, then decoded), "rejected" (none kept)."""
        draft = self.draft or []
        n = 0
        for a, b in zip(draft, token_ids):
            if a != b:
                break
            n += 1
        whole = n == len(draft) == len(token_ids) and finish_reason == self.entry.finish_reason
        return {"result": "verified" if whole else "partial" if n else "rejected",
                "draft_tokens": len(draft), "accepted_tokens": n}


def _text(content) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return "".join(getattr(p, "text", "") or "" for p in content)


def bypass_reason(req, options: CacheOptions) -> str | None:
    """Why a chat request is not served from (nor stored in) the cache, or None."""
    if getattr(req, "cache", None) is False:
        return "opt_out"
    if getattr(req, "tools", None):
        return "tools"
    if req.n != 1 or req.best_of not in (None, 1) or getattr(req, "logprobs", None):
        return "params"
    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature > options.max_temperature:
        return "temperature"
    if not hasattr(req, "messages"):   # a completion
        if req.echo or req.suffix:
            return "params"
        text = _last_text(req)
        if not text:
            return "not_text"
    else:
        last = req.messages[-1] if req.messages else None
        text = _text(last.content) if last is not None else None
        if last is None or last.role != "user" or not text:
            return "not_user"
    if is_creative(text):
        return "creative"
    return None


def _last_text(req) -> str | None:
    """The query: a chat's last message, a completion's prompt when it is one string."""
    if hasattr(req, "messages"):
        return _text(req.messages[-1].content)
    p = req.prompt
    if isinstance(p, str):
        return p
    return p[0] if len(p) == 1 and isinstance(p[0], str) else None


def _space(head: str) -> str:
    """Which vectors a partition holds: the head's digest (entries of another head never match)."""
    loaded = load_head(head)
    return "minilm" if loaded is None else loaded.digest


def policy_digest(moderation) -> str | None:
    """A moderation policy as a partition field (None: no moderation)."""
    if moderation is None:
        return None
    d = asdict(moderation) if is_dataclass(moderation) else repr(moderation)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def make_plan(req, model_name: str, key_name: str | None, options: CacheOptions, moderation=None) -> CachePlan:
    """The request's partition (the exact part, hashed) and its question (embedded normalized).
    `moderation`: the caller's moderation policy (answers never cross policies)."""
    chat = hasattr(req, "messages")
    context, question = split_query(_last_text(req) or "")
    f = facts(question)
    scope = {"key": None if options.shared else key_name, "user": None if options.shared else getattr(req, "user", None),
             "cache_salt": getattr(req, "cache_salt", None), "moderation": policy_digest(moderation)}
    exact = {"model": model_name, "kind": "chat" if chat else "completion", "scope": scope, "facts": f.key(),
             "space": _space(options.head), "context": context, "question": None if question else "",
             "history": [[m.role, _text(m.content)] for m in req.messages[:-1]] if chat else [],
             "params": req.model_dump(exclude=NEUTRAL_FIELDS, exclude_none=True, mode="json")}
    digest = hashlib.sha256(json.dumps(exact, sort_keys=True, default=str).encode()).hexdigest()
    # no short question: the whole message is in the exact part, and what is embedded only labels it
    return CachePlan(partition=digest, query=question or context[:200], arithmetic=f.arithmetic)


class SemanticCache:
    """Lookups and stores; the embedding is the server's shared encoder (embeddings.Embedder)."""

    def __init__(self, backend: CacheBackend, embedder, options: CacheOptions):
        self.backend = backend
        self.embedder = embedder
        self.options = options
        self.head = load_head(options.head)    # a bad file fails here, at startup

    def project(self, vector: np.ndarray) -> np.ndarray:
        """An embedding of a normalized query, in the space the cache compares in."""
        return vector if self.head is None else self.head.project(vector)

    async def lookup(self, plan: CachePlan, vector: np.ndarray | None = None) -> Hit | None:
        """The hit for `plan`; `vector` is its text's embedding when the caller has it already."""
        t0 = time.perf_counter()
        if vector is None:
            vecs, _ = await self.embedder.encode([plan.text], use="semantic_cache")
            vector = vecs[0].numpy()
        if getattr(self.backend, "remote", False):   # a network round trip: off the event loop
            hit = await asyncio.to_thread(self.match, plan, vector)
        else:
            hit = self.match(plan, vector)
        if hit is not None:
            hit.lookup_ms = (time.perf_counter() - t0) * 1000
        return hit

    def match(self, plan: CachePlan, vector: np.ndarray) -> Hit | None:
        """The hit for a plan whose normalized query embeds to `vector` (kept in the plan for the store)."""
        vector = plan.vector = self.project(vector)
        found = self.backend.nearest(plan.partition, vector, time.time(), self.options.ttl_s)
        if found is None:
            return None
        entry, sim = found
        need = self.options.arithmetic_threshold if plan.arithmetic else self.options.threshold
        if sim < need:
            return None
        self.backend.touch(entry, time.time())
        return Hit(entry, sim)

    def store(self, plan: CachePlan, answer: str, finish_reason: str, prompt_tokens: int,
              completion_tokens: int, token_ids: list[int] | None = None) -> None:
        if plan.vector is None or finish_reason not in ("stop", "length"):
            return
        now = time.time()
        self.backend.put(Entry(uuid.uuid4().hex, plan.partition, plan.query, plan.vector, answer, finish_reason,
                               prompt_tokens, completion_tokens, now, now, token_ids), self.options.max_entries)

    def describe(self) -> dict:
        return asdict(self.options)

    def close(self) -> None:
        self.backend.close()
