"""`kvserve bench serve`: vLLM's metric definitions on synthetic timestamps, the workload and the
request bodies, and one tiny run against a real kvserve server started by the command itself.
No timing is asserted."""

from __future__ import annotations

import itertools
import json
import math
import os
import tempfile

import pytest
from typer.testing import CliRunner

from kvserve.bench.cli import app
from kvserve.bench.serve import (
    BenchRequest,
    RequestResult,
    ServeConfig,
    _arrival_gaps,
    build_payload,
    calculate_metrics,
    parse_goodput,
    profile_delta,
    profile_table,
    sample_requests,
)
from kvserve.bench.serve_launch import markdown_table
from kvserve.errors import InvalidRequest


def _req(ttft: float, chunk_times: list[float], n_out: int | None = None, prompt_len: int = 10) -> RequestResult:
    """A finished request whose first chunk arrived at `ttft` and later chunks at `chunk_times`."""
    times = [ttft, *chunk_times]
    return RequestResult(prompt_len=prompt_len, output_tokens=n_out or len(times), ttft=ttft, latency=times[-1],
                         itl=[b - a for a, b in itertools.pairwise(times)], success=True)


def test_metrics_follow_vllm_definitions():
    a = _req(0.1, [0.2, 0.3, 0.4, 0.5])              # 5 tokens: TPOT (0.5-0.1)/4 = 0.1
    b = _req(0.3, [1.3], n_out=3, prompt_len=20)     # usage says 3 tokens in 2 chunks: TPOT 1.0/2 = 0.5
    c = _req(0.2, [])                                # one token: no TPOT sample, TPOT 0 for goodput
    failed = RequestResult(prompt_len=99, error="HTTP 503")
    m = calculate_metrics([a, b, c, failed], duration_s=2.0, goodput={"ttft": 250, "tpot": 200})
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input == 40 and m.total_output == 9           # the failed request counts nothing
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(24.5)
    assert m.ttft_ms["mean"] == pytest.approx(200.0) and m.ttft_ms["median"] == pytest.approx(200.0)
    assert m.tpot_ms["mean"] == pytest.approx(300.0)              # over a and b only
    assert m.tpot_ms["median"] == pytest.approx(300.0)
    assert m.tpot_ms["p99"] == pytest.approx(100 + 0.99 * 400)   # numpy's linear interpolation
    # ITL pools the gaps of all requests: four of 0.1 s and one of 1.0 s.
    assert m.itl_ms["mean"] == pytest.approx(1400.0 / 5) and m.itl_ms["median"] == pytest.approx(100.0)
    assert m.e2el_ms["mean"] == pytest.approx((500 + 1300 + 200) / 3)
    # Goodput: a meets both SLOs; b's TPOT is 500 ms; c's TTFT is 200 ms and its TPOT 0.
    assert m.request_goodput == pytest.approx(2 / 2.0)


def test_metrics_without_goodput_or_successes():
    m = calculate_metrics([RequestResult(error="x")], duration_s=1.0)
    assert m.request_goodput is None and m.completed == 0 and m.output_throughput == 0
    assert "| Failed requests | 1 |" in markdown_table([m])


def test_parse_goodput():
    assert parse_goodput(["ttft:500 tpot:100", "e2el:2000"]) == {"ttft": 500.0, "tpot": 100.0, "e2el": 2000.0}
    assert parse_goodput(None) == {}
    with pytest.raises(InvalidRequest, match="ttft, tpot and e2el"):
        parse_goodput(["itl:5"])
    with pytest.raises(InvalidRequest, match="NAME:MS"):
        parse_goodput(["ttft:fast"])


def test_arrivals_are_poisson_with_the_given_rate():
    assert _arrival_gaps(4, math.inf, 1.0, 0) == [0.0] * 4
    gaps = _arrival_gaps(4000, 8.0, 1.0, 0)
    assert gaps == _arrival_gaps(4000, 8.0, 1.0, 0)              # seeded
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 8.0, rel=0.1)
    assert min(gaps) >= 0


def test_payload_extras_per_backend():
    req = BenchRequest("hi", 1, 7)
    chat = build_payload(req, ServeConfig(), "kvserve", "m")
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and chat["max_tokens"] == 7
    assert chat["ignore_eos"] is True and "n_predict" not in chat and chat["stream_options"]["include_usage"]
    llama = build_payload(req, ServeConfig(endpoint="completions"), "llama-cpp", None)
    assert llama["prompt"] == "hi" and llama["n_predict"] == 7 and "model" not in llama
    assert "ignore_eos" not in build_payload(req, ServeConfig(), "openai", None)


def test_payload_response_format_and_new_schemas():
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    req = BenchRequest("hi", 1, 4)
    body = build_payload(req, ServeConfig(response_format=rf), "kvserve", None)
    assert body["response_format"] == rf
    cfg = ServeConfig(response_format=rf, new_schema_per_request=True)
    a, b = (build_payload(req, cfg, "kvserve", None)["response_format"]["json_schema"]["schema"] for _ in range(2))
    assert a != b and a["type"] == b["type"] == "object" and rf["json_schema"]["schema"] == {"type": "object"}


def test_sample_requests_lengths_and_seed():
    from kvserve.model.gguf_loader import open_gguf
    from kvserve.model.registry import resolve
    from kvserve.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(open_gguf(resolve(None).path))
    cfg = ServeConfig(num_prompts=6, input_len=40, output_len=10, range_ratio=0.5, seed=3)
    reqs = sample_requests(tok, cfg)
    assert [r.prompt for r in reqs] == [r.prompt for r in sample_requests(tok, cfg)]
    assert len({r.prompt for r in reqs}) == 6
    for r in reqs:
        assert r.prompt_len == len(tok.encode(r.prompt, add_special_tokens=False))
        assert 17 <= r.prompt_len <= 60 and 5 <= r.output_len <= 15
    with pytest.raises(InvalidRequest, match="range-ratio"):
        ServeConfig(range_ratio=1.5)
    # a workload with repeats: the last half repeat the first half, word for word and in order
    rep = sample_requests(tok, ServeConfig(num_prompts=6, input_len=40, output_len=10, seed=3, repeat_ratio=0.5))
    assert [r.prompt for r in rep[3:]] == [r.prompt for r in rep[:3]] and len({r.prompt for r in rep}) == 3
    with pytest.raises(InvalidRequest, match="repeat-ratio"):
        ServeConfig(repeat_ratio=1.0)


def test_profile_delta_and_table():
    before = {"phases": {"schedule": 1.0, "forward": 10.0, "output": 0.5, "http": 0.2}, "steps": 100,
              "batched_tokens": 1000, "batched_requests": 400}
    after = {"phases": {"schedule": 1.5, "forward": 14.0, "output": 1.0, "http": 0.7}, "steps": 300,
             "batched_tokens": 7000, "batched_requests": 6400}
    p = profile_delta(before, after, wall_s=5.0)
    assert p["phases"] == pytest.approx({"schedule": 0.5, "forward": 4.0, "output": 0.5, "http": 0.5})
    assert (p["steps"], p["batched_tokens"], p["batched_requests"]) == (200, 6000, 6000)
    table = profile_table(p)
    assert "200 engine steps, 30.0 tokens and 30.0 requests per step, wall 5.00 s" in table
    assert "| forward | engine | 4.00 | 80.0% | 20.00 |" in table
    assert "| **engine busy** | engine | 4.50 | 90.0% | 22.50 |" in table      # schedule + forward
    assert "| engine idle | engine | 0.50 | 10.0% | 2.50 |" in table
    assert "| http | event loop | 0.50 | 10.0% | 2.50 |" in table


def test_bench_serve_against_a_launched_kvserve(tmp_path, scratch):
    res = CliRunner().invoke(app, [
        "serve", "--launch", "kvserve", "--num-prompts", "3", "--concurrency", "2", "--input-len", "24",
        "--output-len", "6", "--goodput", "e2el:3600000", "--profile", "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in scratch.iterdir()) == []   # its data dir and log went with it
    assert "| metric | kvserve |" in res.output
    [m] = json.loads((tmp_path / "serve.json").read_text())
    assert (m["completed"], m["failed"]) == (3, 0)
    assert m["total_output"] == 3 * 6                    # ignore_eos: exactly output_len each
    assert m["total_input"] >= 3 * 24 - 3                # the server's prompt_tokens include the template
    assert m["request_goodput"] == pytest.approx(m["request_throughput"])
    assert 0 < m["ttft_ms"]["median"] <= m["e2el_ms"]["median"]
    assert m["peak_rss_mb"] > 50 and m["vm_hwm_mb"] >= m["peak_rss_mb"] * 0.99
    assert (tmp_path / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --profile: the server's step profile over the load (after the warm-up), printed and kept
    prof = m["extra"]["profile"]
    assert prof["steps"] >= 6 and prof["batched_tokens"] >= 3 * (24 + 5)
    assert prof["phases"]["forward"] > 0 and prof["phases"]["http"] > 0 and prof["phases"]["output"] > 0
    assert "kvserve step profile:" in res.output and "| forward | engine |" in res.output


def test_bench_serve_needs_a_target(tmp_path):
    res = CliRunner().invoke(app, ["serve", "--out-dir", str(tmp_path)])
    assert res.exit_code == 1 and "--base-url" in res.output
    res = CliRunner().invoke(app, ["serve", "--launch", "vllm", "--out-dir", str(tmp_path)])
    assert res.exit_code == 1 and "choose from kvserve, llama-cpp" in res.output


def test_long_prompt_scenario_against_a_launched_kvserve(tmp_path):
    """The three phases run end to end on a small scale and report their numbers (no timing asserted)."""
    from kvserve.bench.scenario import LongPromptConfig, bench_long_prompt
    from kvserve.bench.serve import ServeConfig
    from kvserve.bench.serve_launch import Target, plan_server
    from kvserve.model.loader import load_model

    tok = load_model(None).tokenizer
    sc = LongPromptConfig(long_len=400, num_long=1, num_streams=2, stream_output_len=8, probe_output_len=2,
                          probe_interval_s=0.3, phase_s=3.0, num_alone=2)
    md, data = bench_long_prompt(Target("kvserve", launch="kvserve"), tok, ServeConfig(input_len=24), sc,
                                 plan_server=plan_server)
    assert len(data["alone"]["probe_ttft_s"]) == 2 and all(t > 0 for t in data["alone"]["probe_ttft_s"])
    assert data["streams"]["itl_s"] and data["streams"]["probe_ttft_s"]
    [long] = data["long"]["long"]
    assert long["error"] == "" and long["prompt_len"] >= 390 and long["ttft_s"] > 0
    assert "| long |" in md and "long prompts" in md


def test_bench_serve_unknown_scenario(tmp_path):
    res = CliRunner().invoke(app, ["serve", "--launch", "kvserve", "--scenario", "nope", "--out-dir", str(tmp_path)])
    assert res.exit_code == 1 and "choose default, long-prompt or batch" in res.output


def test_a_launched_server_that_fails_keeps_its_log_and_not_its_data(tmp_path, monkeypatch):
    from kvserve.bench.serve_launch import plan_server
    from kvserve.errors import ModelLoadError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    server = plan_server("kvserve", None, 2, 1, 256, ["--no-such-flag"])
    with pytest.raises(ModelLoadError, match="exited with code") as err:
        server.start(timeout_s=120)
    assert str(server.log_path) in str(err.value) and "no-such-flag" in server.log_path.read_text()
    assert not os.path.exists(server.data_dir)
