"""EngineClient: the server's handle on an engine, the same interface whether the EngineCore runs
in a thread of this process or in a process of its own.

    generate(prompt_token_ids, params, request_id, ...) -> async stream of RequestOutputs
    abort(request_id), stats(), health(), start(), shutdown()

The client does the request's text work on the event loop (kvserve.engine.processing: validation,
n/best_of fan-out, detokenization, stop strings, logprobs) and sends only typed messages to the
core: EngineCoreRequest / AbortRequests in, EngineCoreOutputs back.

* InprocClient: the core's busy loop in a thread; messages go through a queue, outputs come back
  with `loop.call_soon_threadsafe`. Model compute never blocks the event loop.
* MPClient: the core in `python -m kvserve.engine.process`, msgpack over two local ZMQ sockets
  (PUSH requests, PULL outputs). The model is loaded once, in the engine process, which sends the
  tokenizer back in its first message. The HTTP process stays responsive while the model computes.
* RayClient (engine/ray_client.py): N replicas as Ray actors behind one client, routed by
  prefix-cache affinity; `make_engine_client(replicas=N | prefill_replicas=P, decode_replicas=D)`.

The interface and the machinery the transports share are in engine/client_base.py.
"""

from __future__ import annotations

import asyncio
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from kvserve.engine.client_base import EngineClient, EngineDeadError, LoRAClient  # noqa: F401 - the interface, re-exported
from kvserve.engine.messages import (
    CoreInput,
    EngineCoreOutputs,
    EngineFailed,
    EngineReady,
    Shutdown,
    decode_output,
    encode,
    poll_queue,
)
from kvserve.engine.processing import EngineInfo
from kvserve.errors import ModelLoadError


class InprocClient(EngineClient):
    kind = "inproc"

    def __init__(self, core, tokenizer, model_name: str):
        info = EngineInfo(model_name, core.max_model_len, core.block_size, core.model_config.vocab_size,
                          core.context_limited_by_kv)
        super().__init__(tokenizer, info, core.config.enable_prefix_caching)
        self.core = core
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        await super().start()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is not None:
            self._inbox.put(Shutdown())
            await asyncio.to_thread(self._thread.join, 10)
            self._thread = None

    def stats(self) -> dict:
        return self.core.stats()

    def lora_names(self) -> list[str]:
        return self.core.lora.names()

    def add_lora(self, name: str, path: str) -> None:
        self.core.lora.add(name, path)

    def remove_lora(self, name: str) -> None:
        self.core.lora.remove(name)

    def _send(self, msgs: list[CoreInput]) -> None:
        for m in msgs:
            self._inbox.put(m)

    def _run(self) -> None:
        # stats() reads the core directly: no per-step snapshot needed on this path
        self.core.run_busy_loop(self._poll, lambda outs: self._call_soon(self._on_outputs, outs), with_stats=False)

    def _poll(self, timeout: float) -> list[CoreInput]:
        return poll_queue(self._inbox, timeout)


class MPClient(EngineClient):
    kind = "process"

    def __init__(self, ready: EngineReady, proc: subprocess.Popen, ctx, push, pull, tmpdir: str):
        from kvserve.engine.process import tokenizer_from_spec

        info = EngineInfo(ready.model_name, ready.max_model_len, ready.block_size, ready.vocab_size,
                          ready.kv_cache_limited)
        super().__init__(tokenizer_from_spec(ready.tokenizer), info, ready.enable_prefix_caching)
        self.proc, self._ctx, self._push, self._pull, self._tmpdir = proc, ctx, push, pull, tmpdir
        self._reader: threading.Thread | None = None
        self._closing = False

    @classmethod
    def launch(cls, model: str | None, weight_format: str, engine_kwargs: dict, timeout: float = 900) -> MPClient:
        """Start the engine process and wait until its model is loaded (blocking)."""
        import msgspec
        import zmq

        tmpdir = tempfile.mkdtemp(prefix="kvserve-engine-")
        ctx = zmq.Context()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        push.setsockopt(zmq.LINGER, 0)
        in_addr, out_addr = f"ipc://{tmpdir}/in", f"ipc://{tmpdir}/out"
        push.bind(in_addr)
        pull.bind(out_addr)
        spec = msgspec.json.encode({"model": model, "weight_format": weight_format, "engine_kwargs": engine_kwargs,
                                    "input": in_addr, "output": out_addr, "parent_pid": os.getpid()}).decode()
        proc = subprocess.Popen([sys.executable, "-m", "kvserve.engine.process", spec], stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout
            while not pull.poll(250):
                if proc.poll() is not None:
                    raise ModelLoadError(f"the engine process exited with code {proc.returncode} while loading")
                if time.monotonic() > deadline:
                    raise ModelLoadError(f"the engine process did not load the model in {timeout:.0f} s")
            msg = decode_output(pull.recv())
            if isinstance(msg, EngineFailed):
                raise ModelLoadError(msg.message)
            if not isinstance(msg, EngineReady):
                raise ModelLoadError(f"the engine process sent {type(msg).__name__} before it was ready")
        except BaseException:
            proc.kill()
            proc.wait()
            push.close()
            pull.close()
            ctx.term()
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        client = cls(msg, proc, ctx, push, pull, tmpdir)
        from kvserve.engine.lora import parse_lora_modules
        client._lora_names = list(parse_lora_modules(engine_kwargs.get("lora_modules")))
        return client

    async def start(self) -> None:
        await super().start()
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, args=(self._call_soon,),
                                            name="kvserve-engine-reader", daemon=True)
            self._reader.start()

    def _read(self, call_soon: Callable) -> None:
        """Reader thread: decode each message from the engine process and hand it to the loop."""
        while not self._closing:
            if self._pull.poll(200):
                msg = decode_output(self._pull.recv())
                if isinstance(msg, EngineCoreOutputs):
                    call_soon(self._on_outputs, msg)
            elif self.proc.poll() is not None:
                if not self._closing:
                    call_soon(self._fail_all, f"the engine process exited with code {self.proc.returncode}")
                return

    def _send(self, msgs: list[CoreInput]) -> None:
        for m in msgs:
            self._push.send(encode(m))

    async def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self.proc.poll() is None:
            self._push.send(encode(Shutdown()))
            try:
                await asyncio.to_thread(self.proc.wait, 10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, 5)
        self._push.close()
        self._pull.close()
        self._ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def health(self) -> None:
        if self._dead is None and self.proc.poll() is not None and not self._closing:
            self._dead = f"the engine process exited with code {self.proc.returncode}"
        super().health()


def make_engine_client(model: str | None = None, *, engine_process: bool = False, weight_format: str = "auto",
                       replicas: int | str = 1, prefill_replicas: int = 0, decode_replicas: int = 0,
                       ray_address: str | None = None, target_ttft_ms: float | None = None,
                       replica_idle_seconds: float = 60.0, **engine_kwargs) -> EngineClient:
    """Load `model` and return a client for it (blocking: call it from a thread). With
    `engine_process`, the engine runs in its own process; with several replicas (or a Ray address,
    or prefill/decode pools) in Ray actors behind one client (engine/ray_client.py)."""
    from kvserve.engine.config import EngineConfig

    cfg = EngineConfig(weight_format=weight_format, **engine_kwargs)   # bad options fail here, in this process
    from kvserve.engine.ray_cluster import check_pools, parse_replicas

    lo, hi = parse_replicas(replicas)
    if hi > 1 or prefill_replicas or decode_replicas or ray_address:
        from kvserve.engine.ray_client import RayClient

        check_pools(replicas, prefill_replicas, decode_replicas, engine_process)
        return RayClient.launch(model, weight_format, engine_kwargs, replicas=lo, max_replicas=hi,
                                target_ttft_ms=target_ttft_ms, replica_idle_seconds=replica_idle_seconds,
                                ray_address=ray_address, prefill_replicas=prefill_replicas,
                                decode_replicas=decode_replicas)
    if engine_process:
        return MPClient.launch(model, weight_format, engine_kwargs)
    from kvserve.engine.core import EngineCore
    from kvserve.engine.executor import load_engine_model

    loaded = load_engine_model(model, weight_format, cfg)
    core = EngineCore(loaded.model, cfg, loaded.tokenizer.eos_token_ids, loaded.tokenizer)
    return InprocClient(core, loaded.tokenizer, loaded.source.name)


