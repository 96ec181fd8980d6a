"""The Batch API scales out: two gateways on one PostgreSQL database (as replicas behind a load
balancer) share a batch's lines, each line answered by exactly one of them, the batch created on
one and finished and read on either. Tiny random models in this process keep it fast."""

from __future__ import annotations

import json
import time

import openai
from client_api_server import NO_CLIENT_WARNINGS, loaded, no_client_warnings, tiny_model  # noqa: F401 (autouse)
from servers import InProcessServer

from kvserve.server.settings import ServerSettings
from kvserve.server.stores.keys import KeyStore

pytestmark = NO_CLIENT_WARNINGS
LINES = 48


def test_two_gateways_share_a_batch(tmp_path, postgres_server):
    url = postgres_server.new_database()
    store = KeyStore(url)
    key = store.create("batcher")
    store.close()
    tiny = tiny_model(tmp_path / "tiny.gguf")
    answered: dict[int, list[int]] = {0: [], 1: []}

    def settings(i: int) -> ServerSettings:
        (tmp_path / str(i)).mkdir()
        return ServerSettings(model=str(tiny), served_model_name="tiny", data_dir=tmp_path / str(i), database_url=url,
                              semantic_cache=False, batch_concurrency=1)

    with InProcessServer(settings(0)) as one, InProcessServer(settings(1)) as two:
        for i, srv in enumerate((loaded(one), loaded(two))):
            runner = srv.state.batch_runner
            answer = runner._answer_line

            async def spy(row, line, i=i, answer=answer):
                answered[i].append(line["line"])
                await answer(row, line)

            runner._answer_line = spy
        c1, c2 = (openai.OpenAI(base_url=s.base_url + "/v1", api_key=key, max_retries=0) for s in (one, two))
        body = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                   "body": {"messages": [{"role": "user", "content": f"Count to {i}."}],
                                            "max_tokens": 32, "ignore_eos": True}}) + "\n" for i in range(LINES))
        f = c1.files.create(file=("in.jsonl", body.encode()), purpose="batch")
        b = c1.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 600
        while (b := c2.batches.retrieve(b.id)).status not in ("completed", "failed", "cancelled", "expired"):
            assert time.monotonic() < deadline, b
            time.sleep(0.3)
        assert b.status == "completed" and b.request_counts.completed == LINES and b.request_counts.failed == 0
        out = [json.loads(x) for x in c1.files.content(b.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in out) == sorted(f"r{i}" for i in range(LINES))
    assert sorted(answered[0] + answered[1]) == list(range(LINES))      # each line run by one gateway, once
    assert answered[0] and answered[1], answered                        # and both took lines
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 32 for r in out)
