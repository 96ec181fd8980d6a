"""`kvserve bench serve --scenario multi-turn`: its table and KV pool without a server, and the whole
command, tiny, against launched kvserve servers (RAM only and with the disk tier, each restarted once).
The numbers themselves are in BENCHMARKS.md (issue 51); no time is asserted here."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvserve.bench.cli import app
from kvserve.bench.multi_turn import (
    Conversation,
    MultiTurnConfig,
    Turn,
    kv_bytes_per_token,
    multi_turn_table,
    phase_stats,
    pool_args,
)


def _run(label: str, ttft: float, cached: int) -> dict:
    turns = [Turn(0, 0, "first turns", ttft_s=1.0, prompt_tokens=100, cached_tokens=0, answer="a"),
             Turn(0, 1, "returns", ttft_s=ttft, prompt_tokens=200, cached_tokens=cached, answer="b"),
             Turn(1, 1, "returns", error="HTTP 503: busy")]
    return {"label": label, "disk_blocks": {"returns": cached // 16} if cached else {},
            "answers": [t.answer for t in turns],
            "phases": {p: phase_stats([t for t in turns if t.phase == p]) for p in ("first turns", "returns")}}


def test_phase_stats_and_the_side_by_side_table():
    s = phase_stats([Turn(0, 0, "returns", ttft_s=0.5, prompt_tokens=200, cached_tokens=150),
                     Turn(1, 0, "returns", ttft_s=1.5, prompt_tokens=200, cached_tokens=50),
                     Turn(2, 0, "returns", error="boom")])
    assert (s["requests"], s["failed"], s["prompt_tokens"], s["cached_tokens"]) == (3, 1, 400, 200)
    assert s["hit_rate"] == 0.5 and s["ttft_median_ms"] == 1000.0
    assert phase_stats([Turn(0, 0, "returns", ttft_s=0.5, prompt_tokens=10)])["hit_rate"] is None

    table = multi_turn_table([_run("ram", 2.0, 0), _run("disk", 0.5, 160)])
    lines = table.splitlines()
    assert lines[0] == "| metric | ram | disk |"
    assert "| returns: requests (failed) | 2 (1) | 2 (1) |" in lines
    assert "| returns: prefix-hit rate | 0.0% | 80.0% |" in lines
    assert "| returns: median TTFT (ms) | 2,000.0 | 500.0 |" in lines
    assert "| returns: blocks read from the disk tier | - | 10 |" in lines
    assert "| first turns: prefix-hit rate | 0.0% | 0.0% |" in lines
    assert ("disk vs ram: returns: median TTFT 0.25x, prefix-hit rate 80.0% vs 0.0%; "
            "answers the same as ram's: 2 of 3") in table


def test_the_pool_holds_a_share_of_the_conversations_unless_given():
    mt = MultiTurnConfig(conversations=8, turns=3, system_len=1000, user_len=40, output_len=20)
    convs = [Conversation("doc", 1000, ["q"] * 4) for _ in range(8)]
    assert pool_args(None, ["--kv-cache-memory=1GiB"], convs, mt)[0] == []
    [arg], note = pool_args(None, ["--kv-cache-dtype", "int8"], convs, mt)
    size = int(arg.split("=")[1])
    per_token = kv_bytes_per_token(None, "int8")
    assert size % (16 * per_token) == 0
    tokens = size // per_token
    assert 0.25 * 8 * 1000 < tokens < 0.4 * 8 * 1400      # about 30% of what all eight need
    assert f"{tokens:,} tokens" in note


def test_multi_turn_against_launched_kvserve_ram_and_disk(tmp_path, scratch):
    res = CliRunner().invoke(app, [
        "serve", "--launch", "kvserve", "--scenario", "multi-turn", "--conversations", "2", "--turns", "2",
        "--system-len", "40", "--user-len", "8", "--output-len", "4", "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in scratch.iterdir()) == []   # data dirs, disk tier and logs went with them
    assert "| metric | kvserve RAM only | kvserve disk tier |" in res.output
    assert "kvserve disk tier vs kvserve RAM only: returns: median TTFT" in res.output
    runs = json.loads((tmp_path / "serve-multi-turn.json").read_text())
    assert [r["label"] for r in runs] == ["kvserve RAM only", "kvserve disk tier"]
    for r in runs:
        assert list(r["phases"]) == ["first turns", "returns", "after restart"]
        assert [p["requests"] for p in r["phases"].values()] == [2, 2, 2]
        assert all(p["failed"] == 0 and p["cached_tokens"] is not None and p["ttft_median_ms"] > 0
                   for p in r["phases"].values())
        assert [(t["conversation"], t["turn"]) for t in r["turns"] if t["error"]] == []
        assert sorted((t["conversation"], t["turn"]) for t in r["turns"]) == [(c, t) for c in (0, 1) for t in (0, 1, 2)]
        # each turn re-sends the history: the second turn's prompt is longer than the first's
        first = {t["conversation"]: t["prompt_tokens"] for t in r["turns"] if t["turn"] == 0}
        assert all(t["prompt_tokens"] > first[t["conversation"]] + 8 for t in r["turns"] if t["turn"] == 1)
