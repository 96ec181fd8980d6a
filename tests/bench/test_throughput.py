"""`kvserve bench throughput` at a tiny size: it runs end to end, every engine does the same work
(same prompts, exactly the drawn output lengths), and the table, JSON and chart are written.
No timing is asserted."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvserve.bench.cli import app
from kvserve.bench.throughput import ThroughputConfig, make_workload
from kvserve.errors import InvalidRequest

TINY = ["-n", "3", "--input-min", "4", "--input-max", "9", "--output-min", "2", "--output-max", "4"]


def test_workload_is_seeded_and_within_bounds():
    cfg = ThroughputConfig(num_prompts=20, input_min=3, input_max=7, output_min=1, output_max=5, seed=4)
    a, b = make_workload(cfg, 49152), make_workload(cfg, 49152)
    assert a == b
    assert all(3 <= len(p) <= 7 for p in a.prompts) and all(1 <= n <= 5 for n in a.output_lens)
    assert all(100 <= t < 30000 for p in a.prompts for t in p)
    assert make_workload(ThroughputConfig(num_prompts=20, seed=5), 49152) != make_workload(
        ThroughputConfig(num_prompts=20, seed=4), 49152)


def test_bad_ranges_and_peers_are_invalid_requests():
    with pytest.raises(InvalidRequest, match="input_min"):
        ThroughputConfig(input_min=10, input_max=5)
    with pytest.raises(InvalidRequest, match="unknown peer 'vllm'"):
        ThroughputConfig(peers=["vllm"])


def test_cli_with_transformers_peer_writes_table_json_and_chart(tmp_path):
    res = CliRunner().invoke(app, ["throughput", *TINY, "--peer", "transformers", "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "| kvserve |" in res.output and "| transformers |" in res.output
    data = json.loads((tmp_path / "throughput.json").read_text())
    assert [r["engine"] for r in data] == ["kvserve", "transformers"]
    wl = make_workload(ThroughputConfig(num_prompts=3, input_min=4, input_max=9, output_min=2, output_max=4), 49152)
    for r in data:
        assert r["num_requests"] == 3
        assert r["prompt_tokens"] == wl.prompt_tokens and r["output_tokens"] == wl.output_tokens
        assert r["requests_per_s"] > 0 and r["total_tps"] > r["output_tps"] > 0
    assert (tmp_path / "throughput.md").read_text().count("\n") == 4
    assert (tmp_path / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_peer_is_a_clean_cli_error(tmp_path):
    res = CliRunner().invoke(app, ["throughput", *TINY, "--peer", "vllm", "--out-dir", str(tmp_path)])
    assert res.exit_code == 1
    assert "unknown peer 'vllm'" in res.output
