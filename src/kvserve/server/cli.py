"""`kvserve serve` (mounted by the top-level kvserve.cli); `kvserve keys ...` is in keys_cli.py."""

from __future__ import annotations

import logging
import pathlib
import sys

import typer

from kvserve.engine.spec_decode.config import NUM_SPEC_HELP, SPECULATIVE_HELP
from kvserve.engine.step_cost import DEFAULT_MAX_STEP_MS
from kvserve.errors import InvalidRequest, KVServeError
from kvserve.server.cli_common import DatabaseUrl, DataDir, RedisUrl, user_errors
from kvserve.server.keys_cli import keys_app
from kvserve.server.settings import ServerSettings, default_data_dir
from kvserve.server.stores.common import redact


def _secret(value: str | None, file: pathlib.Path | None, option: str) -> str | None:
    """A secret from its option (or environment variable), or from a file (its first line), so it
    need not appear on the command line where `ps` shows it."""
    if file is None:
        return value
    if value is not None:
        typer.echo(f"error: give {option} or {option}-file, not both", err=True)
        raise typer.Exit(2)
    try:
        text = file.read_text().strip()
    except OSError as e:
        typer.echo(f"error: {option}-file {file}: {e.strerror}", err=True)
        raise typer.Exit(2) from None
    if not text:
        typer.echo(f"error: {option}-file {file} is empty", err=True)
        raise typer.Exit(2)
    return text.splitlines()[0].strip()


def _setup_logging() -> None:
    access = logging.getLogger("kvserve.access")
    if not access.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        access.addHandler(handler)
        access.setLevel(logging.INFO)
        access.propagate = False
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def serve(
    model: list[str] = typer.Option(None, "--model",  # noqa: B008 - typer's idiom
                                    help="Model name or path (default: the embedded SmolLM2); NAME=PATH serves it "
                                         "as NAME. Repeatable: each model gets its own engine and KV budget."),
    models_config: pathlib.Path = typer.Option(None, "--models-config",  # noqa: B008
                                               help="JSON/TOML file: {\"models\": [{name, path, kv_cache_memory, "
                                                    "cost_per_1k_tokens, ...}], \"router\": {...}, "
                                                    "\"semantic_cache\": {...}} (docs/models.md)."),
    router_opt: str = typer.Option(None, "--router", help="Serve a router under this name (e.g. auto): it sends each "
                               "request to the cheapest model predicted good enough (docs/models.md)."),
    models_dir: str = typer.Option(None, "--models-dir", help="Serve each model in this directory (.gguf files, "
                                   "Hugging Face directories) on demand: loaded by the first request naming it, "
                                   "unloaded after --keep-alive idle (docs/api.md)."),
    models_memory: str = typer.Option(None, "--models-memory", help="Memory the resident models may take: bytes, "
                                      "a size such as 8GiB or a fraction of RAM (default 0.75 of the available); "
                                      "past it the least recently used idle model on demand is unloaded."),
    keep_alive: str = typer.Option(None, "--keep-alive", help="How long a model on demand stays loaded after its "
                                   "last request: 5m (default), seconds, 1h; 0: unload at once; negative: forever."),
    keep_alive_max: str = typer.Option("1h", "--keep-alive-max", help="The longest keep_alive a request may ask "
                                       "for (Ollama's field; longer ones, and negative ones, are clamped to it)."),
    model_loads_per_minute: int = typer.Option(6, "--model-loads-per-minute", min=1, help="Loads of models on "
                                               "demand one key may start a minute (past it: 429); the --api-key "
                                               "has no limit."),
    semantic_cache: str = typer.Option("on", "--semantic-cache", help="on or off: answer repeated and "
                                       "paraphrased requests from the semantic cache (docs/models.md)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    redis_url: RedisUrl = None,
    api_key: str = typer.Option(None, "--api-key", envvar="KVSERVE_API_KEY",
                                help="Require this key (on top of any created with `kvserve keys`); better "
                                     "from $KVSERVE_API_KEY or --api-key-file, which `ps` does not show."),
    api_key_file: pathlib.Path = typer.Option(None, "--api-key-file",  # noqa: B008 - typer's idiom
                                              help="Read --api-key from this file."),
    served_model_name: str = typer.Option(None, help="Name clients use in \"model\"."),
    lora: list[str] = typer.Option(None, "--lora",  # noqa: B008 - typer's idiom
                                   help="A LoRA adapter (PEFT directory) served as model NAME: NAME=PATH. "
                                        "Repeatable."),
    max_loras: int = typer.Option(8, min=1, help="LoRA adapters kept in memory at once (LRU)."),
    admin_key: str = typer.Option(None, "--admin-key", envvar="KVSERVE_ADMIN_KEY",
                                  help="Key of the admin endpoints (/v1/load_lora_adapter, "
                                       "/v1/unload_lora_adapter); without it they are off."),
    admin_key_file: pathlib.Path = typer.Option(None, "--admin-key-file",  # noqa: B008 - typer's idiom
                                                help="Read --admin-key from this file."),
    metrics_key: str = typer.Option(None, "--metrics-key", envvar="KVSERVE_METRICS_KEY",
                                    help="/metrics needs this key (default: any API key; docs/security.md)."),
    metrics_key_file: pathlib.Path = typer.Option(None, "--metrics-key-file",  # noqa: B008 - typer's idiom
                                                  help="Read --metrics-key from this file."),
    max_embedding_inputs: int = typer.Option(2048, min=1, help="Inputs of one /v1/embeddings request."),
    max_embedding_tokens: int = typer.Option(65_536, min=1, help="Tokens of one /v1/embeddings request."),
    quota: list[str] = typer.Option(None, "--quota",  # noqa: B008 - typer's idiom
                                    help="A store's per-key quota, STORE:items=N,bytes=SIZE,ttl=DURATION (stores: "
                                         "responses, conversations, arena, batches (also active=N,lines=N); e.g. "
                                         "responses:items=1000,ttl=7d). "
                                         "Repeatable."),
    max_running: int = typer.Option(32, help="Requests handed to the engine at once."),
    max_waiting: int = typer.Option(128, help="Requests that may wait for a slot; beyond it, 503."),
    ladder_route_cheaper_at: int = typer.Option(32, help="Queue length at which the router (model \"auto\") "
                                                "sends every request to the cheapest model."),
    ladder_cap_at: int = typer.Option(64, help="Queue length at which max_tokens is capped."),
    ladder_cap_max_tokens: int = typer.Option(128, help="The max_tokens cap under load."),
    ladder_reject_free_at: int = typer.Option(96, help="Queue length at which free-tier keys get 503."),
    default_max_tokens: int = typer.Option(512, help="max_tokens when a chat request sends none."),
    max_model_len: int = typer.Option(None, help="Context window to serve (default: the model's)."),
    long_prefill_token_threshold: int = typer.Option(
        None, min=1, help="A prompt with more tokens than this is long: it prefills in chunks of at most this "
                          "many per step (default: half the step's token budget)."),
    max_num_partial_prefills: int = typer.Option(2, min=1, help="Long prompts prefilling at once."),
    max_step_ms: float = typer.Option(DEFAULT_MAX_STEP_MS, min=0, help="Cut long prompts' chunks so a step's "
                                      "predicted time stays under this many ms (0: no target)."),
    max_decode_slowdown: float = typer.Option(1.6, min=0, help="With a step target, steps with running streams "
                                              "take on average at most this times their time without long "
                                              "prompts' chunks (the streams' inter-token latency; 0: off, the "
                                              "step target alone)."),
    kv_cache_memory: str = typer.Option(None, help="KV cache size: bytes, a size such as 2GiB, or a fraction "
                                                   "of RAM such as 0.2 (default 1GiB)."),
    kv_cache_dtype: str = typer.Option("fp16", "--kv-cache-dtype", help="KV cache element type: auto (fp16), "
                                       "fp16, bf16, fp32, or int8 (per-row scales: ~1.9x the tokens in the same "
                                       "memory)."),
    kv_offload_dir: str = typer.Option(None, "--kv-offload-dir", help="A second KV tier on local disk: full "
                                       "blocks are kept in this directory (shared by replicas and restarts of the "
                                       "same model) and read back instead of recomputed (off by default)."),
    kv_offload_size: str = typer.Option("20GiB", "--kv-offload-size", help="Most bytes in --kv-offload-dir "
                                        "as a whole, whichever replica or model wrote them (least recently "
                                        "used blocks out first)."),
    engine_process: bool = typer.Option(False, "--engine-process",
                                        help="Run the engine in its own process (msgpack over a local ZMQ "
                                             "socket), so the HTTP process stays responsive while the model "
                                             "computes."),
    replicas: str = typer.Option("1", help="Engine replicas as Ray actors behind this gateway, routed by "
                                            "prefix-cache affinity (a local Ray cluster unless --ray-address); "
                                            "a dead one is restarted. MIN:MAX scales between the two on queue "
                                            "depth and --target-ttft-ms."),
    target_ttft_ms: float = typer.Option(None, "--target-ttft-ms", help="With --replicas MIN:MAX: start another "
                                                                        "replica while the median time to first "
                                                                        "token stays above this."),
    replica_idle_seconds: float = typer.Option(60.0, help="With --replicas MIN:MAX: drain a replica above MIN "
                                                          "after this long with nothing to do."),
    ray_address: str = typer.Option(None, "--ray-address", help="Join this Ray cluster (HOST:PORT or auto) "
                                                                "for the replicas."),
    prefill_replicas: int = typer.Option(0, min=0, help="Disaggregated serving: replicas that only prefill "
                                                        "prompts and ship their KV blocks to the decode pool."),
    decode_replicas: int = typer.Option(0, min=0, help="Disaggregated serving: replicas that decode."),
    tensor_parallel_size: int = typer.Option(1, min=1, help="Split each layer's heads and MLP over this many "
                                                            "processes (torch.distributed)."),
    prefix_cache_scope: str = typer.Option("key", help="Who shares prefix-cache blocks: key (each API key "
                                                       "its own), tier, or global (single tenant)."),
    shared_prompt: list[str] = typer.Option(None, "--shared-prompt",  # noqa: B008 - typer's idiom
                                            help="A public prompt (text, or @FILE) every key may hit in the "
                                                 "prefix cache, e.g. the system prompt all clients send. "
                                                 "Repeatable."),
    max_body_bytes: int = typer.Option(1 << 20, help="Largest request body of the API (413 past it)."),
    conversation_quota_bytes: int = typer.Option(64 << 20, help="Saved conversations per key (413 past it)."),
    batch_concurrency: int = typer.Option(4, help="Batch API lines run at once, below interactive traffic."),
    header_timeout: float = typer.Option(10.0, help="Seconds for a request's line and headers to arrive."),
    body_timeout: float = typer.Option(30.0, help="Seconds for each chunk of a request body (408 past it)."),
    shutdown_grace: float = typer.Option(5.0, help="On SIGTERM, seconds in-flight requests may finish."),
    speculative: str = typer.Option(None, "--speculative", help=SPECULATIVE_HELP),
    num_speculative_tokens: int = typer.Option(None, "--num-speculative-tokens", help=NUM_SPEC_HELP),
    moderation: str = typer.Option("input,output", "--moderation",
                                   help="Moderate input,output | input | output | off (server/gates/moderation.py)."),
    moderation_config: str = typer.Option(None, "--moderation-config",
                                          help="JSON file of moderation settings: thresholds, blocklist, regexes, "
                                               "pii_input (off|flag|redact), pii_output (off|redact), check_every."),
    arena_contestants: str = typer.Option(None, "--arena-contestants",
                                          help="JSON list of arena contestants {name, model?, system?, "
                                               "temperature?, top_p?, max_tokens?}; default: the served model "
                                               "under three system prompts."),
) -> None:
    """Serve the OpenAI-compatible API (and the web chat page) with one model."""
    from kvserve.server import serving
    from kvserve.server.app import create_app
    from kvserve.server.routing.cache_scope import SCOPES

    _setup_logging()
    if prefix_cache_scope not in SCOPES:
        typer.echo(f"error: --prefix-cache-scope must be one of {', '.join(SCOPES)}", err=True)
        raise typer.Exit(2)
    shared = []
    for text in shared_prompt or []:
        if text.startswith("@"):
            try:
                text = pathlib.Path(text[1:]).read_text()
            except OSError as e:
                typer.echo(f"error: --shared-prompt {text}: {e.strerror}", err=True)
                raise typer.Exit(2) from None
        shared.append(text)
    from kvserve.server.stores.moderation_policies import load_options

    with user_errors(2):
        moderation_options = load_options(moderation, moderation_config)
    engine_kwargs: dict = {k: v for k, v in [("max_model_len", max_model_len),
                                             ("long_prefill_token_threshold", long_prefill_token_threshold),
                                             ("max_num_partial_prefills", max_num_partial_prefills),
                                             ("max_step_ms", max_step_ms),
                                             ("max_decode_slowdown", max_decode_slowdown),
                                             ("kv_cache_dtype", kv_cache_dtype)] if v is not None}
    if replicas != "1":
        from kvserve.engine.ray_cluster import parse_replicas
        with user_errors(2):
            parse_replicas(replicas)
        engine_kwargs.update(replicas=replicas, replica_idle_seconds=replica_idle_seconds)
        if target_ttft_ms is not None:
            engine_kwargs["target_ttft_ms"] = target_ttft_ms
    if kv_offload_dir:
        from kvserve.engine.config import parse_bytes
        with user_errors(2):
            parse_bytes(kv_offload_size, param="kv_offload_size")    # fail now, not after loading
        engine_kwargs.update(kv_offload_dir=kv_offload_dir, kv_offload_size=kv_offload_size)
    engine_kwargs.update({k: v for k, v in [("ray_address", ray_address),
                                            ("prefill_replicas", prefill_replicas),
                                            ("decode_replicas", decode_replicas),
                                            ("tensor_parallel_size", tensor_parallel_size)] if v})
    if engine_kwargs.get("tensor_parallel_size") == 1:
        del engine_kwargs["tensor_parallel_size"]
    if speculative or num_speculative_tokens is not None:
        from kvserve.engine.spec_decode.config import SpeculativeConfig
        with user_errors(2):
            SpeculativeConfig.parse(speculative, num_speculative_tokens)     # fail now, not after loading
        engine_kwargs.update(speculative=speculative, num_speculative_tokens=num_speculative_tokens)
    if lora:
        from kvserve.engine.lora import parse_lora_modules
        with user_errors(2):
            engine_kwargs["lora_modules"] = parse_lora_modules(lora)
            from kvserve.model.lora import read_config
            for path in engine_kwargs["lora_modules"].values():   # files exist and are LoRA: fail before the load
                read_config(path)
    engine_kwargs["max_loras"] = max_loras
    if kv_cache_memory:
        engine_kwargs["kv_cache_memory"] = (int(kv_cache_memory) if kv_cache_memory.isdigit() else
                                            float(kv_cache_memory) if kv_cache_memory.replace(".", "", 1).isdigit()
                                            else kv_cache_memory)
    from kvserve.server.routing.pool import model_options

    with user_errors(2):
        models, router, cache_options, on_demand = model_options(model or [], models_config, models_dir,
                                                                 models_memory, keep_alive)
        from kvserve.server.routing.residency import parse_keep_alive

        longest = parse_keep_alive(keep_alive_max, "--keep-alive-max")
        if longest is None or longest < 0:
            raise InvalidRequest("--keep-alive-max must be a duration such as 1h.", param="keep_alive_max")
        on_demand["keep_alive_max_s"] = longest
        on_demand["model_loads_per_minute"] = model_loads_per_minute
        router_name = router_opt
    if semantic_cache not in ("on", "off"):
        typer.echo("error: --semantic-cache must be on or off", err=True)
        raise typer.Exit(2)
    if router_name:
        router = {**(router or {}), "name": router_name}
    single = models[0] if len(models) == 1 and not models_config and not on_demand["models_dir"] else None
    from kvserve.server.stores.quota import quota_options

    with user_errors(2):
        quotas = quota_options(quota or [])
    settings = ServerSettings(
        model=single.path if single else None, models=[] if single else models, router=router,
        semantic_cache=semantic_cache == "on", semantic_cache_options=cache_options,
        served_model_name=served_model_name or (single.name if single else None), data_dir=data_dir or default_data_dir(),
        api_key=_secret(api_key, api_key_file, "--api-key"),
        admin_key=_secret(admin_key, admin_key_file, "--admin-key"),
        metrics_key=_secret(metrics_key, metrics_key_file, "--metrics-key"), quotas=quotas,
        max_embedding_inputs=max_embedding_inputs, max_embedding_tokens=max_embedding_tokens, max_running=max_running, max_waiting=max_waiting, ladder_cap_at=ladder_cap_at,
        ladder_route_cheaper_at=ladder_route_cheaper_at,
        ladder_cap_max_tokens=ladder_cap_max_tokens, ladder_reject_free_at=ladder_reject_free_at,
        default_max_tokens=default_max_tokens, engine_process=engine_process, engine_kwargs=engine_kwargs,
        prefix_cache_scope=prefix_cache_scope, shared_prompts=shared, max_body_bytes=max_body_bytes,
        conversation_quota_bytes=conversation_quota_bytes, batch_concurrency=batch_concurrency, header_timeout_s=header_timeout,
        body_timeout_s=body_timeout, arena_contestants=arena_contestants, database_url=database_url,
        redis_url=redis_url, moderation=moderation, moderation_options=moderation_options, **on_demand)
    with user_errors(2):
        sock = serving.bind(host, port)
    try:
        app = create_app(None, settings)
    except KVServeError as e:
        sock.close()
        typer.echo(f"error: {e.message}", err=True)
        raise typer.Exit(1) from None
    where = redact(database_url) if database_url else settings.db_path
    typer.echo(f"kvserve: listening on http://{host}:{port} (OpenAI API under /v1; keys in {where})", err=True)
    code = serving.run(app, sock, header_timeout_s=header_timeout, grace_s=shutdown_grace)
    if code:
        typer.echo(f"error: the model could not be loaded: {app.state.server.load_error}", err=True)
        raise typer.Exit(code)


def main() -> None:
    """`python -m kvserve.server` runs `serve`; `python -m kvserve.server keys ...` the key commands."""
    app = typer.Typer(add_completion=False)
    app.command("serve")(serve)
    app.add_typer(keys_app, name="keys")
    app()
