"""Both engine clients on the real default model: the in-process thread and the engine process
(msgpack over ZMQ) give the same answers, stream deltas, stop on strings (and abort the core's
request), fan out n, refuse bad requests before they reach the core, free everything on abort,
and report a dead engine process instead of hanging."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from kvserve.engine.client import EngineDeadError, make_engine_client
from kvserve.errors import ContextLengthExceeded, InvalidRequest
from kvserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module", params=["inproc", "process"])
def client(request):
    c = make_engine_client(None, engine_process=request.param == "process", kv_cache_memory="128MiB",
                           kv_cache_dtype="fp32", weight_format="fp32")
    assert c.kind == request.param
    yield c
    if c.kind == "process" and c.proc.poll() is None:
        asyncio.run(c.shutdown())


def run(client, coro):
    async def main():
        await client.start()
        return await coro()
    return asyncio.run(main())


async def collect(client, ids, params, rid):
    outs = [out async for out in client.generate(ids, params, rid)]
    return outs


def test_generate_streams_and_matches_the_sync_engine(client):
    from kvserve import LLM

    ids = client.tokenizer.encode("The capital of France is")
    outs = run(client, lambda: collect(client, ids, GREEDY, "a"))
    final = outs[-1].outputs[0]
    assert final.finish_reason == "length" and len(final.token_ids) == 12
    assert "".join(o.outputs[0].text_delta for o in outs) == final.text
    assert all(len(pos) >= 1 for pos in final.logprobs)
    m = outs[-1].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    ref = LLM(weight_format="fp32", kv_cache_memory="128MiB", kv_cache_dtype="fp32")
    expect = ref.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].outputs[0]
    assert final.token_ids == expect.token_ids and final.text == expect.text


def test_stop_string_n_and_validation(client):
    ids = client.tokenizer.encode("1, 2, 3, 4,")

    async def body():
        stop = SamplingParams(temperature=0, max_tokens=40, stop=[" 7"])
        outs = await collect(client, ids, stop, "s")
        many = await collect(client, ids, SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=5), "n")
        errors = []
        for params in (SamplingParams(max_tokens=10**7), ):
            try:
                await collect(client, ids, params, "bad")
            except ContextLengthExceeded as e:
                errors.append(e)
        try:
            await collect(client, [client.info.vocab_size + 5], SamplingParams(max_tokens=2), "oov")
        except InvalidRequest as e:
            errors.append(e)
        await asyncio.sleep(0.2)
        return outs[-1], many[-1], errors, client.stats()

    last, many, errors, stats = run(client, body)
    assert last.outputs[0].finish_reason == "stop" and last.outputs[0].stop_reason == " 7"
    assert not last.outputs[0].text.endswith(" 7") and " 6" in last.outputs[0].text
    assert sorted(c.index for c in many.outputs) == [0, 1, 2] and many.finished
    assert len(errors) == 2
    assert stats["num_requests_running"] == 0 and stats["kv_blocks_used"] == 0


def test_abort_mid_stream_frees_the_core(client):
    ids = client.tokenizer.encode("Once upon a time")

    async def body():
        agen = client.generate(ids, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True), "long")
        async for _ in agen:
            break
        await agen.aclose()
        for _ in range(50):
            await asyncio.sleep(0.05)
            s = client.stats()
            if s["num_requests_running"] == 0 and s["kv_blocks_used"] == 0:
                return s
        return client.stats()

    s = run(client, body)
    assert s["num_requests_running"] == 0 and s["kv_blocks_used"] == 0
    assert client.outputs.requests == {}


def test_engine_process_death_is_reported():
    c = make_engine_client(None, engine_process=True, kv_cache_memory="64MiB")

    async def body():
        await c.start()
        ids = c.tokenizer.encode("Tell me a long story")
        agen = c.generate(ids, SamplingParams(max_tokens=400, ignore_eos=True), "x")
        await agen.__anext__()
        os.kill(c.proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in agen:
                pass
        with pytest.raises(EngineDeadError):
            c.health()
        await c.shutdown()

    asyncio.run(body())


def test_engine_process_outlives_the_thread_that_started_it():
    """The server loads the model in a short-lived thread: the engine process must not die with it."""
    import threading

    box = {}
    t = threading.Thread(target=lambda: box.setdefault("c", make_engine_client(
        None, engine_process=True, kv_cache_memory="64MiB")))
    t.start()
    t.join()
    c = box["c"]

    async def body():
        await c.start()
        outs = await collect(c, c.tokenizer.encode("Hello"), SamplingParams(temperature=0, max_tokens=3), "t")
        await c.shutdown()
        return outs

    assert asyncio.run(body())[-1].finished
    assert c.proc.returncode == 0


def test_an_orphaned_engine_process_exits_and_removes_its_sockets(tmp_path):
    """A server killed without its shutdown (SIGKILL) leaves its engine process behind: that process
    must exit by itself and take the server's temp dir of ZMQ sockets with it."""
    import pathlib
    import subprocess
    import sys
    import time

    parent = subprocess.Popen([sys.executable, "-c", (
        "import os\n"
        "from kvserve.engine.client import make_engine_client\n"
        "c = make_engine_client(None, engine_process=True, kv_cache_memory='64MiB')\n"
        "print(c.proc.pid, c._tmpdir, flush=True)\n"
        "os.kill(os.getpid(), 9)\n")], stdout=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    pid, sockets = parent.stdout.readline().split()
    parent.wait(timeout=60)
    assert parent.returncode == -signal.SIGKILL and sockets.startswith(str(tmp_path))

    def running() -> bool:   # a zombie (nobody reaped it yet) has exited
        try:
            return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and running():
        time.sleep(0.1)
    assert not running()
    assert not os.path.exists(sockets)
