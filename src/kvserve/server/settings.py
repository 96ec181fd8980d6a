"""Server configuration: one dataclass that the CLI fills and `create_app` reads."""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass, field


def default_data_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("KVSERVE_DATA_DIR", pathlib.Path.home() / ".kvserve"))


@dataclass
class ServerSettings:
    # What to serve. `model=None` is the embedded default; `load_model=False` runs the gateway alone
    # (health stays 503 and generation endpoints answer 503), which the gateway tests use.
    model: str | None = None
    served_model_name: str | None = None  # name clients send in "model"; defaults to the engine's name
    load_model: bool = True
    engine_process: bool = False   # run the engine in its own process (msgpack over local ZMQ sockets)
    weight_format: str = "auto"
    engine_kwargs: dict = field(default_factory=dict)
    # Several models (server/routing/pool.py): ModelSpecs from `--model NAME=PATH` or a config
    # file; when empty, the one model above. `router`: the "auto" model's config
    # (server/routing/model_router.py), or None.
    models: list = field(default_factory=list)
    router: dict | None = None
    # Models on demand (server/routing/residency.py): every model in `models_dir` (GGUF files, HF
    # directories) is loaded by the first request that names it and unloaded after `keep_alive_s`
    # idle (negative: never), the least recently used first when the resident models would exceed
    # `models_memory` (bytes, a size such as "8GiB", a fraction of RAM; None: 3/4 of the RAM
    # available at start). A request waits for its model's load up to `model_load_timeout_s`.
    models_dir: str | None = None
    models_memory: int | float | str | None = None
    keep_alive_s: float = 300.0
    keep_alive_max_s: float = 3600.0   # a request's keep_alive is clamped to this (negative: to this too)
    model_loads_per_minute: int = 6    # loads of models on demand one key may start a minute
    model_load_timeout_s: float = 120.0
    # The semantic cache (server/routing/semantic_cache.py): on by default; its options
    # (threshold, ttl_s, ...).
    semantic_cache: bool = True
    semantic_cache_options: dict = field(default_factory=dict)

    # Prefix-cache isolation (routing/cache_scope.py): "key" | "tier" | "global", and operator-declared
    # prompts (e.g. a public system prompt) whose blocks every caller may hit.
    prefix_cache_scope: str = "key"
    shared_prompts: list[str] = field(default_factory=list)

    data_dir: pathlib.Path = field(default_factory=default_data_dir)
    # Shared state (server/stores/): PostgreSQL for keys, usage and conversations instead of the
    # SQLite file in data_dir; Redis for the key-lookup cache, rate-limit buckets and live counters
    # instead of this process's memory. None: the embedded stores.
    database_url: str | None = None
    redis_url: str | None = None
    api_key: str | None = None  # a key accepted on top of the database's keys (name "api-key")
    admin_key: str | None = None  # the operator's key for the admin endpoints (run-time LoRA loading)
    metrics_key: str | None = None  # set: /metrics needs this key (None: any valid API key, docs/security.md)
    arena_contestants: str | None = None  # JSON file of arena contestants (server/api/arena.py); None = defaults

    # Default per-key limits for keys created without their own (None = unlimited).
    default_rpm: int | None = None
    default_tpm: int | None = None

    # Request caps: every one is a 400 with `param` when exceeded.
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0       # per chunk of a request body (408 past it)
    header_timeout_s: float = 10.0     # a connection's request line + headers (closed past it)
    max_json_depth: int = 64
    max_tools: int = 128
    max_tools_bytes: int = 1 << 18     # the JSON of all tool definitions of one request
    max_messages: int = 256
    max_n: int = 8
    max_best_of: int = 8
    max_top_logprobs: int = 20
    max_stop: int = 16
    max_stop_chars: int = 1024         # each stop string (the detokenizer holds back up to this much)
    max_logit_bias: int = 300          # logit_bias entries (OpenAI's cap)
    max_prompts: int = 32  # list prompts in one /v1/completions request
    max_embedding_inputs: int = 2048      # inputs of one /v1/embeddings request (OpenAI's cap)
    max_embedding_tokens: int = 65_536    # their tokens, as the encoder counts them (~2 s of one core)
    default_max_tokens: int = 512  # when the client sends none (still capped by the context window)

    # Overload: at most `max_running` requests are handed to the engine at once; the others wait in a
    # priority queue (paid before free) of at most `max_waiting`; past it, 503 + Retry-After.
    max_running: int = 32
    max_waiting: int = 128
    # Degradation ladder, by current queue length: cap max_tokens, then reject free tier, then all.
    ladder_route_cheaper_at: int | None = 32   # "auto" requests go to the cheapest model (model_router.py)
    ladder_cap_at: int | None = 64
    ladder_cap_max_tokens: int = 128
    ladder_reject_free_at: int | None = 96
    retry_after_s: float = 2.0

    # Moderation (server/gates/moderation.py, stages/output_moderation.py): "input,output" |
    # "input" | "output" | "off", and the rest of
    # safety.ModerationConfig's fields (thresholds, blocklist, regexes, pii_input, pii_output, ...).
    moderation: str = "input,output"
    moderation_options: dict = field(default_factory=dict)

    # The conversation API (web page): body cap and per-owner storage quota.
    conversation_body_bytes: int = 8 << 20
    conversation_quota_bytes: int = 64 << 20
    # Per-owner quotas of the stores a key can write (stores/quota.py): {store: "items=N,bytes=SIZE,
    # ttl=DURATION"} over the store's defaults (`--quota STORE:...`).
    quotas: dict[str, str] = field(default_factory=dict)

    def quota(self, store: str):
        """The `QuotaLimits` of `store` ("responses", "conversations", "arena", ...)."""
        from dataclasses import replace

        from kvserve.server.stores.quota import DEFAULT_QUOTAS, QuotaLimits

        base = DEFAULT_QUOTAS[store]
        if store == "conversations":
            base = replace(base, max_bytes=self.conversation_quota_bytes)
        return QuotaLimits.parse(self.quotas.get(store, ""), base)

    # Files and batches (api/files.py, api/batches.py): an upload's cap, each key's files quota, and
    # how many batch lines run at once (at a priority below every interactive request).
    file_max_bytes: int = 64 << 20
    file_quota_count: int = 500
    file_quota_bytes: int = 1 << 30
    batch_concurrency: int = 4

    def store_limits(self):
        from kvserve.server.stores.conversations import StoreLimits

        quota = self.quota("conversations")
        unlimited = 1 << 62
        return StoreLimits(max_body_bytes=self.conversation_body_bytes,
                           max_owner_bytes=unlimited if quota.max_bytes is None else quota.max_bytes,
                           max_conversations_per_owner=unlimited if quota.max_items is None else quota.max_items,
                           body_timeout_s=self.body_timeout_s, max_json_depth=self.max_json_depth)

    def file_limits(self):
        from kvserve.server.stores.files import FileLimits

        return FileLimits(max_file_bytes=self.file_max_bytes, max_owner_files=self.file_quota_count,
                          max_owner_bytes=self.file_quota_bytes)

    def moderation_config(self):
        from kvserve.safety.moderator import ModerationConfig

        return ModerationConfig().merged({**self.moderation_options, "mode": self.moderation})

    @property
    def db_path(self) -> pathlib.Path:
        return pathlib.Path(self.data_dir) / "kvserve.db"
