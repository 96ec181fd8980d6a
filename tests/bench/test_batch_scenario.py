"""`kvserve bench serve --scenario batch`'s pieces without a server: the JSONL it uploads and the
table it prints (the whole command runs against a real server in BENCHMARKS.md, issue 50)."""

from __future__ import annotations

import json

from kvserve.bench.batch import BatchRun, BatchScenario, batch_file, batch_table
from kvserve.bench.serve import RequestResult


def stream(gap: float, ttft: float = 0.1) -> RequestResult:
    return RequestResult(success=True, ttft=ttft, times=[ttft + i * gap for i in range(5)])


def test_batch_file_is_one_chat_line_per_custom_id():
    lines = [json.loads(x) for x in batch_file(BatchScenario(lines=20, line_tokens=8), "m").decode().splitlines()]
    assert [x["custom_id"] for x in lines] == [f"line-{i}" for i in range(20)]
    assert {x["url"] for x in lines} == {"/v1/chat/completions"} and {x["method"] for x in lines} == {"POST"}
    assert all(x["body"]["max_tokens"] == 8 and x["body"]["model"] == "m" for x in lines)
    assert "model" not in json.loads(batch_file(BatchScenario(lines=1), None).decode())["body"]


def test_table_gives_the_itl_ratio_and_the_batch_counts():
    run = BatchRun(idle=[stream(0.02)] * 3, during=[stream(0.03)] * 4, wall_s=10.0,
                   batch={"status": "completed", "request_counts": {"total": 20, "completed": 20, "failed": 0}})
    table = batch_table("kvserve", BatchScenario(lines=20, line_tokens=16), run)
    rows = table.splitlines()
    assert rows[2].startswith("| idle | 3 | 20.0 |") and rows[2].endswith("| 1.00x |")
    assert rows[3].startswith("| batch running | 4 | 30.0 |") and rows[3].endswith("| 1.50x |")
    assert "completed in 10.0 s (2.00 lines/s), completed 20, failed 0, duplicate answers 0, missing 0" in table
