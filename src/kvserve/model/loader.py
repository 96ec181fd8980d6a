"""load_model: any model source -> (model, tokenizer, config), ready for the engine.

This is where the kernel backend is chosen (once per loaded model, from the CPU's features and
the KVSERVE_* switches; see kernels/backend.py) and handed to every layer that uses it. A GGUF
file is memory-mapped and its tensors used where they lie; the layers the C kernels need in
their own layout are repacked once per file and cached (kernels/pack_cache.py), so a later load
maps the packed copy instead of rewriting it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.model.config import ModelConfig
from kvserve.model.decoder import DecoderLM
from kvserve.model.kernels import pack_cache
from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.registry import ModelSource, resolve
from kvserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: DecoderLM
    tokenizer: Tokenizer
    config: ModelConfig
    source: ModelSource
    load_seconds: float
    backend: KernelBackend


def _pack_session(path, reader, weight_format: str, backend: KernelBackend) -> pack_cache.PackSession | None:
    """A pack-cache session where the loaded layers are the C kernels' packed ones and nothing
    else (no bf16 copies made from the file's bytes, no stacked experts): else None."""
    if (backend.lib is None or backend.bf16_min_tokens is not None or weight_format not in ("auto", "gguf")
            or not pack_cache.enabled() or any(len(t.shape) != 2 and len(t.shape) != 1 for t in reader.tensors)):
        return None
    try:
        return pack_cache.PackSession.open(Path(path), weight_format)
    except OSError as e:
        logger.warning("kvserve: packed-weight cache unavailable (%s)", e)
        return None


def _gguf_tokenizer(path, reader) -> Tokenizer:
    from kvserve.tokenizer.tokenizer import gguf_field

    if not pack_cache.enabled() or gguf_field(reader, "tokenizer.ggml.model") not in ("gpt2", "llama"):
        return Tokenizer.from_gguf(reader)       # (which says what is wrong)
    try:
        hf = _cached_tokenizer(Path(path), lambda: Tokenizer.hf_from_gguf(reader))
    except OSError:
        hf = None
    return Tokenizer.from_gguf(reader, hf)


def _cached_tokenizer(gguf_path: Path, build_bpe):
    """The file's BPE tokenizer (a `tokenizers.Tokenizer`): read from the cache's JSON, else made
    by `build_bpe()` and written there (a 128k vocabulary and its merges take about a second to
    build from GGUF strings, a tenth of that to read back)."""
    from tokenizers import Tokenizer as HFTokenizer

    path = pack_cache.cache_root() / f"{pack_cache.file_key(gguf_path)}.tokenizer.json"
    with contextlib.suppress(Exception):    # a missing or unreadable entry is rebuilt
        return HFTokenizer.from_file(str(path))
    hf = build_bpe()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        pack_cache.atomic_write(path, hf.to_str().encode())
    return hf


def _build(cfg: ModelConfig, weights: dict, weight_format: str, backend: KernelBackend,
           session: pack_cache.PackSession | None) -> DecoderLM:
    with torch.no_grad(), pack_cache.active(session):
        net = DecoderLM.from_weights(cfg, weights, weight_format, backend=backend).eval()
    if session is not None:     # an untied embedding table is read a row per token: not mapped whole
        session.finish(tuple(m for m in (getattr(net, "packed_embed", None),) if m is not None))
    return net


def load_model(model: str | None = None, weight_format: str = "auto", *, device: str | torch.device = "cpu",
               isa: str | None = None, backend: KernelBackend | None = None) -> LoadedModel:
    """Load `model` (a built-in name, a .gguf file or a Hugging Face directory; None = the default).

    weight_format: auto (GGUF quants stay packed), gguf, fp32, bf16, fp16, q8_0 (dense weights packed
        into Q8_0 blocks at load).
    device: where the model runs; on anything but the CPU only PyTorch paths are used.
    isa: force a lower kernel ISA level than the CPU's (avx2, avx512, amx; as KVSERVE_ISA).
    backend: a KernelBackend made by the caller (then device and isa are not used).
    """
    t0 = time.perf_counter()
    if backend is None:
        backend = KernelBackend.detect(device=device, isa=isa)
    src = resolve(model)
    if src.kind == "gguf":
        from kvserve.model.gguf_loader import config_from_gguf, open_gguf, weights_from_gguf

        reader = open_gguf(src.path)
        cfg = config_from_gguf(reader, src.name)
        tok = _gguf_tokenizer(src.path, reader)
        session = _pack_session(src.path, reader, weight_format, backend)
        net = None
        if session is not None and session.hit:
            try:
                net = _build(cfg, weights_from_gguf(reader, cfg, cached=True), weight_format, backend, session)
            except Exception as e:  # noqa: BLE001 - build from the file instead: a real error recurs there
                logger.warning("kvserve: packed-weight cache not used for %s (%s)", src.path, e)
                session = pack_cache.PackSession(session.path)     # records again, rewrites the entry
        if net is None:
            net = _build(cfg, weights_from_gguf(reader, cfg), weight_format, backend, session)
        del reader
    else:
        from kvserve.model.hf_loader import config_from_dir, weights_from_dir

        cfg = config_from_dir(src.path)
        tok = Tokenizer.from_dir(src.path)
        net = _build(cfg, weights_from_dir(src.path, cfg), weight_format, backend, None)
    if torch.device(backend.device).type != "cpu":
        net.to(backend.device)
    release_freed_heap()
    return LoadedModel(net, tok, cfg, src, time.perf_counter() - t0, backend)


def release_freed_heap(min_free: int = 0) -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim): a load frees the
    file's metadata, the tokenizer's build and (on a first load) staging copies, and glibc keeps
    those pages: 60 MB of RSS after a 1.1B GGUF's load, 210 MB after a 3B's first load.
    min_free: only when the heap holds at least this many free bytes (mallinfo2; a trim that
    would give back little costs more than it saves: the pages are faulted in again)."""
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError, TypeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if min_free:
            libc.mallinfo2.restype = _MallInfo2
            if libc.mallinfo2().fordblks < min_free:
                return
        libc.malloc_trim(0)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                      "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
