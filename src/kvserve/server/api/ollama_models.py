"""Ollama's `/api/tags`, `/api/show` and `/api/ps`: what they say about a model, read from its files.

`/api/tags` lists what `/v1/models` lists, from the same cards; `/api/ps` the generative models
running, each with its weights and KV cache as `size` (`size_vram` 0: kvserve runs on the CPU here)
and its served window as `context_length`; `/api/show` one model, with its chat template and
capabilities ("insert" when its vocabulary has fill-in-the-middle tokens, api/ollama_fim.py).

Each served model's weights are found as the engine found them (`model/registry.py`: a built-in
name, a .gguf file or a Hugging Face directory; the sentence encoder's zip) and described once per
file version (path, size, mtime), off the event loop (at startup, in a background thread, for a
server that loads its models; else on the first ask):

    size                 bytes on disk (a directory: the sum of its files)
    digest               sha256 of the content (a directory: of its files' names and digests)
    details              format (gguf, safetensors), family (general.architecture or config.json's
                         model_type), parameter_size counted from the tensors ("134.52M", as Ollama
                         writes it), quantization_level (general.file_type; a directory: its dtype)
    model_info           the file's scalar metadata (`general.*`, `<arch>.*`, as Ollama shows it),
                         with general.parameter_count

A model with no file of its own (the router, a LoRA adapter) has size 0, a digest of its name
and, for an adapter, its parent's details.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import pathlib
import struct
import threading
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from kvserve.errors import InvalidRequest, ModelNotFound
from kvserve.server.api.ollama_fim import fim_tokens
from kvserve.server.generation import ModelHandle
from kvserve.server.protocol import _Strict, read_request

if TYPE_CHECKING:
    from kvserve.server.state import ServerState

logger = logging.getLogger("kvserve.server")
NEVER_EXPIRES = "2318-01-01T00:00:00Z"   # /api/ps: a pinned (--model) model, or keep_alive < 0, stays loaded

_LIST_MAX = 16      # longer metadata lists (the vocabulary) stay out of model_info, as Ollama's non-verbose show
_TORCH_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


@dataclass(frozen=True)
class ModelFacts:
    size: int = 0
    digest: str = ""
    format: str = ""
    family: str = ""
    parameter_size: str = ""
    quantization_level: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    modified: float = 0.0     # the file's mtime (0: no file)

    def details(self, parent: str = "") -> dict[str, Any]:
        return {"parent_model": parent, "format": self.format, "family": self.family,
                "families": [self.family] if self.family else None, "parameter_size": self.parameter_size,
                "quantization_level": self.quantization_level}


_FACTS: dict[tuple[str, int, int], ModelFacts] = {}
_FACTS_LOCK = threading.Lock()     # one reader hashes a file; the others wait for its facts
# The model files' facts are read (and hashed on first sight: seconds for a large file) by this one
# thread, never in the event loop's default pool that tokenizing, templates and stores share: a
# client listing /api/tags in a loop queues behind itself, not in front of everyone's requests.
_FACTS_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-model-facts")


def human_number(n: int) -> str:
    """A parameter count as Ollama writes it: 134515008 -> "134.52M", 8030261248 -> "8.0B"."""
    for unit, scale, digits in (("B", 1e9, 1), ("M", 1e6, 2), ("K", 1e3, 0)):
        if n >= scale:
            x = n / scale
            return f"{x:.0f}{unit}" if x == int(x) else f"{x:.{digits}f}{unit}"
    return str(n)


def _sha256(path: pathlib.Path) -> str:
    """The file's SHA-256, memoized on disk by the pack cache (the loader hashes the same file)."""
    from kvserve.model.kernels.pack_cache import file_digest

    return file_digest(path)


def _gguf(path: pathlib.Path) -> ModelFacts:
    from gguf import LlamaFileType

    from kvserve.model.gguf_loader import open_gguf
    from kvserve.tokenizer.tokenizer import gguf_field

    reader = open_gguf(path)      # checked for truncation and absurd counts; one pass over a memory map
    params = sum(int(t.n_elements) for t in reader.tensors)
    info: dict[str, Any] = {}
    for key in reader.fields:
        if key.startswith(("GGUF.", "tokenizer.")):
            continue
        value = gguf_field(reader, key)
        if isinstance(value, (str, int, float, bool)) or (isinstance(value, list) and len(value) <= _LIST_MAX):
            info[key] = value
    info["general.parameter_count"] = params
    file_type = info.get("general.file_type")
    try:
        quant = LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_") if file_type is not None else ""
    except ValueError:
        quant = ""
    return ModelFacts(size=path.stat().st_size, digest=_sha256(path), format="gguf",
                      family=str(info.get("general.architecture", "")), parameter_size=human_number(params),
                      quantization_level=quant, info=info)


def _safetensors_params(header: dict[str, Any]) -> tuple[int, str]:
    """(parameter count, the most common dtype) from a safetensors header."""
    count, by_dtype = 0, {}
    for name, t in header.items():
        if name == "__metadata__" or not isinstance(t, dict):
            continue
        n = 1
        for d in t.get("shape", []):
            n *= int(d)
        count += n
        by_dtype[t.get("dtype", "")] = by_dtype.get(t.get("dtype", ""), 0) + n
    return count, max(by_dtype, key=by_dtype.get) if by_dtype else ""


def _header(read_head) -> dict[str, Any]:
    (n,) = struct.unpack("<Q", read_head(8))
    return json.loads(read_head(n))


def _weights(files: dict[str, Any], config: dict[str, Any], size: int, digest: str) -> ModelFacts:
    """Facts of a safetensors model from `files` (name -> a callable opening that file as a stream)."""
    params, dtype = 0, ""
    for name, open_ in sorted(files.items()):
        if name.endswith(".safetensors"):
            with open_() as f:
                n, dtype = _safetensors_params(_header(f.read))
            params += n
    info = {f"{config.get('model_type', 'model')}.{k}": v for k, v in config.items()
            if isinstance(v, (str, int, float, bool)) and k != "model_type"}
    info |= {"general.architecture": config.get("model_type", ""), "general.parameter_count": params}
    return ModelFacts(size=size, digest=digest, format="safetensors", family=str(config.get("model_type", "")),
                      parameter_size=human_number(params) if params else "",
                      quantization_level=_TORCH_DTYPES.get(str(config.get("torch_dtype")), dtype), info=info)


def _directory(path: pathlib.Path) -> ModelFacts:
    files = sorted(p for p in path.rglob("*") if p.is_file())
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.relative_to(path)}\0{_sha256(p)}\n".encode())
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    return _weights({str(p.relative_to(path)): (lambda p=p: p.open("rb")) for p in files}, config,
                    sum(p.stat().st_size for p in files), h.hexdigest())


def _zip(path: pathlib.Path) -> ModelFacts:
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        config = json.loads(z.read("config.json")) if "config.json" in names else {}
        return _weights({n: (lambda n=n: z.open(n)) for n in names}, config, path.stat().st_size, _sha256(path))


def file_facts(path: pathlib.Path) -> ModelFacts:
    """The facts of a model file or directory (blocking: hashes the content on first sight)."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _FACTS_LOCK:
        if key not in _FACTS:
            read = _directory if path.is_dir() else _zip if zipfile.is_zipfile(path) else _gguf
            _FACTS[key] = dataclasses.replace(read(path), modified=st.st_mtime)
        return _FACTS[key]


def model_facts(source: str | None) -> ModelFacts:
    """The facts of the generative model a `--model` spec names (None: the default model)."""
    from kvserve.model.registry import resolve

    try:
        return file_facts(resolve(source).path)
    except Exception as e:   # noqa: BLE001 - the listing answers without a file it cannot read
        logger.warning("cannot describe the model file of %r for /api/tags: %s", source, e)
        return ModelFacts()


def encoder_facts() -> ModelFacts:
    """The facts of the sentence encoder (its package's zip)."""
    from kvserve.model.bert import minilm_zip

    try:
        return file_facts(minilm_zip())
    except Exception as e:   # noqa: BLE001 - as model_facts
        logger.warning("cannot describe the sentence encoder's file for /api/tags: %s", e)
        return ModelFacts()


def named(name: str, family: str = "") -> ModelFacts:
    """A model without a file of its own: size 0, a digest of its name."""
    return ModelFacts(digest=hashlib.sha256(name.encode()).hexdigest(), family=family)


class ShowBody(_Strict):
    model: str | None = None
    name: str | None = None      # older clients
    verbose: bool | None = None


def served_name(name: str) -> str:
    """Ollama's default tag is implied: "smollm2:latest" asks for "smollm2"."""
    return name.removesuffix(":latest")


def model_entry(card: dict[str, Any], facts: ModelFacts) -> dict[str, Any]:
    """One model of /api/tags (and, with more, of /api/ps), from its /v1/models card and its facts."""
    name = card["id"]
    modified = facts.modified or card["created"]
    return {"name": name, "model": name, "modified_at": datetime.fromtimestamp(modified, UTC).isoformat(),
            "size": facts.size, "digest": facts.digest, "details": facts.details(card.get("parent") or "")}


def warm(sources: list[str | None]) -> None:
    """Read the served models' files (and the encoder's) ahead of the first /api/tags."""
    for source in sources:
        model_facts(source)
    encoder_facts()


def mount_ollama_models(app: FastAPI, gw: ServerState) -> None:
    settings = gw.settings
    if settings.load_model:     # a server that loads its models hashes their files meanwhile, in the background
        threading.Thread(target=warm, args=([e.spec.path for e in gw.pool.entries],), name="kvserve-model-facts",
                         daemon=True).start()

    def cards(request: Request) -> list[dict[str, Any]]:
        """/v1/models' cards: another key's LoRA adapter is not listed (api/models.py); models on
        demand (--models-dir) are, loaded or not."""
        created = int(datetime.now(UTC).timestamp())
        return gw.pool.cards(created, request.state.record.key_name, unloaded=True) + gw.routing.model_cards(created)

    def card(request: Request, name: str) -> dict[str, Any]:
        found = next((c for c in cards(request) if c["id"] == served_name(name)), None)
        if found is None:
            raise ModelNotFound(f"model '{name}' not found", param="model")
        return found

    def facts_of(c: dict[str, Any]) -> ModelFacts:
        """Blocking (hashes a file on first sight): the facts of a card's model."""
        kind = c.get("kvserve_kind")
        if kind == "embedding":
            return encoder_facts()
        entry = next((e for e in gw.pool.entries if e.name == (c.get("parent") or c["id"])), None)
        if kind is not None or entry is None:
            return named(c["id"], kind or "")
        facts = model_facts(entry.spec.path)
        return dataclasses.replace(named(c["id"], facts.family), format=facts.format) if c.get("parent") else facts

    async def facts(cs: list[dict[str, Any]]) -> list[ModelFacts]:
        return await asyncio.get_running_loop().run_in_executor(_FACTS_POOL, lambda: [facts_of(c) for c in cs])

    @app.get("/api/tags")
    async def tags(request: Request) -> dict:
        cs = cards(request)
        return {"models": [model_entry(c, f) for c, f in zip(cs, await facts(cs))]}

    @app.get("/api/ps")
    async def ps() -> dict:
        cs = [c for c in gw.pool.cards(int(datetime.now(UTC).timestamp())) if not c.get("parent")]
        expires = {st.name: st.expires_at for st in gw.pool.statuses(loaded_only=True)}   # on demand: keep_alive
        out = []
        for c, f in zip(cs, await facts(cs)):
            engine = next((e.engine for e in gw.pool.loaded() if e.name == c["id"]), None)
            st = engine.stats() if engine is not None else {}
            kv = int(st.get("kv_cache_bytes_per_token", 0) or 0) * int(st.get("kv_cache_capacity_tokens", 0) or 0)
            entry = model_entry(c, f)
            del entry["modified_at"]
            until = expires.get(c["id"])
            out.append(entry | {"size": f.size + kv, "size_vram": 0,
                                "expires_at": NEVER_EXPIRES if until is None else datetime.fromtimestamp(
                                    until, UTC).isoformat().replace("+00:00", "Z"),
                                "context_length": c["max_model_len"]})
        return {"models": out}

    @app.post("/api/show")
    async def show(request: Request) -> dict:
        body = await read_request(request, ShowBody, settings)
        name = body.model or body.name
        if not name:
            raise InvalidRequest("model is required.", param="model")
        c = card(request, name)
        [f] = await facts([c])
        info = {"general.architecture": f.family, **f.info}
        capabilities, template = ["completion", "tools", "thinking"], ""
        if c.get("kvserve_kind") == "embedding":
            capabilities, info = ["embedding"], {**info, "embedding_length": c.get("dimensions")}
        elif c.get("max_model_len"):
            info["context_length"] = c["max_model_len"]     # the served window (the file's is <arch>.context_length)
            tokenizer = ModelHandle.resolve(gw, c["id"], request.state.record.key_name).tokenizer
            template = tokenizer.chat_template or ""
            if fim_tokens(tokenizer) is not None:
                capabilities.append("insert")
        return {"modelfile": f"FROM {c['id']}\n", "parameters": "", "template": template,
                "details": f.details(c.get("parent") or ""), "model_info": info, "capabilities": capabilities,
                "modified_at": model_entry(c, f)["modified_at"]}
