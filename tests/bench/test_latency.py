"""`kvserve bench latency` and `kernels` at tiny sizes: they run end to end and write their outputs.
No timing is asserted; only that the numbers exist, are positive and land in the table and chart."""

from __future__ import annotations

import importlib.util
import json

import pytest
from typer.testing import CliRunner

from kvserve.bench.cli import app
from kvserve.bench.kernel_latency import kernel_latency, kernel_table
from kvserve.bench.latency import KvserveRunner, LatencyConfig, prompt_ids


def test_latency_cli_writes_table_json_and_chart(tmp_path):
    res = CliRunner().invoke(app, ["latency", "-n", "8", "-m", "2", "--repeats", "1", "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "| kvserve |" in res.output
    data = json.loads((tmp_path / "latency.json").read_text())
    assert [r["engine"] for r in data] == ["kvserve"]
    assert data[0]["prefill_tps"] > 0 and data[0]["decode_tps"] > 0
    assert (tmp_path / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_several_input_lengths_give_a_row_each(tmp_path):
    res = CliRunner().invoke(app, ["latency", "--input-len", "8,24", "-m", "2", "--repeats", "1",
                                   "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "latency.json").read_text())
    assert [(r["engine"], r["prompt_tokens"]) for r in data] == [("kvserve", 8), ("kvserve", 24)]
    assert "| kvserve | 24 |" in res.output
    bad = CliRunner().invoke(app, ["latency", "--input-len", "8,x", "--out-dir", str(tmp_path)])
    assert bad.exit_code == 2 and "--input-len takes positive integers" in bad.output


def test_unknown_peer_is_a_clean_error(tmp_path):
    res = CliRunner().invoke(app, ["latency", "-n", "4", "-m", "1", "--peer", "vllm", "--out-dir", str(tmp_path)])
    assert res.exit_code == 1
    assert "unknown peer 'vllm'" in res.output


def test_kvserve_runner_decodes_greedily_and_repeatably():
    runner = KvserveRunner(LatencyConfig(prompt_tokens=8, decode_tokens=3))
    ids = prompt_ids(runner.vocab_size, 8, seed=0)
    assert len(ids) == 8 and all(100 <= i < runner.vocab_size for i in ids)
    prefill_s, decode_s = runner.run(ids, 3)
    assert prefill_s > 0 and decode_s > 0


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")
def test_llama_cpp_peer(tmp_path):
    res = CliRunner().invoke(app, ["latency", "-n", "8", "-m", "2", "--repeats", "1", "--peer", "llama-cpp",
                                   "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert [r["engine"] for r in json.loads((tmp_path / "latency.json").read_text())] == ["kvserve", "llama.cpp"]


def test_kernel_bench_tiny():
    rows = kernel_latency([1, 3], shapes=[(64, 64, "Q4_1"), (32, 64, "Q8_0")], threads=1)
    assert len(rows) == 4
    assert all(r["auto_us"] > 0 and r["fp32_us"] > 0 and r["bf16_us"] > 0 for r in rows)
    table = kernel_table(rows)
    assert table.count("\n") == 5 and "| 64x64 | Q4_1 | 3 |" in table


def test_latency_speculative_end_to_end(tmp_path):
    """`bench latency --speculative`: both arms interleaved on one workload, the same greedy tokens,
    a best-of and a paired ratio per row, and the outputs written."""
    res = CliRunner().invoke(app, ["latency", "--speculative", "ngram", "--decode-tokens", "12", "--repeats", "2",
                                   "--spec-workloads", "grounded", "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "paired speedup, median (range)" in res.output
    base, spec = json.loads((tmp_path / "latency_speculative.json").read_text())
    assert (base["engine"], spec["engine"]) == ("baseline", "ngram") and base["workload"] == spec["workload"]
    assert base["output_tokens"] == spec["output_tokens"] > 0 and spec["identical"] is True
    assert base["paired"] is None and len(spec["paired"]) == 2 * 4      # 2 repeats x the 4 grounded prompts
    assert all(r > 0 for r in spec["paired"]) and spec["paired_median"] > 0
    assert f"n = {len(spec['paired'])})" in (tmp_path / "latency_speculative.md").read_text()
    bad = CliRunner().invoke(app, ["latency", "--speculative", "ngram", "--spec-workloads", "chat",
                                   "--out-dir", str(tmp_path)])
    assert bad.exit_code == 1 and "unknown workload 'chat'" in bad.output


def _spinners_of(pid: int) -> list[int]:
    """Live busy-core processes (bench/busy.py) whose parent is `pid`."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"0x1FFFFF" in cmd:
            found.append(int(entry))
    return found


def test_busy_cores_spin_inside_and_are_gone_after_even_on_error():
    import os

    from kvserve.bench.busy import BusyCores

    with BusyCores(2) as busy:
        assert len(busy.pids) == 2 and sorted(_spinners_of(os.getpid())) == sorted(busy.pids)
        for pid in busy.pids:   # running, not sleeping: they take CPU
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().rsplit(")", 1)[1].split()[0] in ("R", "S")
    assert _spinners_of(os.getpid()) == []
    with pytest.raises(RuntimeError, match="inside"), BusyCores(1):
        raise RuntimeError("inside the block")
    assert _spinners_of(os.getpid()) == []
    with BusyCores(0) as none:
        assert none.pids == []


def test_busy_spinner_exits_by_itself_after_its_limit():
    import os

    from kvserve.bench.busy import BusyCores

    busy = BusyCores(1, limit_s=0.2).__enter__()
    try:
        proc = busy.procs[0]
        proc.wait(timeout=30)        # the deadline, checked every ~0.1 s of spinning
        assert proc.returncode == 0
    finally:
        busy.__exit__(None, None, None)
    assert _spinners_of(os.getpid()) == []


def test_latency_busy_cores_gives_a_quiet_and_a_busy_row(tmp_path):
    import os

    res = CliRunner().invoke(app, ["latency", "-n", "8", "-m", "2", "--repeats", "1", "--busy-cores", "1",
                                   "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "latency.json").read_text())
    assert [(r["engine"], r["busy_cores"]) for r in data] == [("kvserve", 0), ("kvserve", 1)]
    assert all(r["prefill_tps"] > 0 and r["decode_tps"] > 0 for r in data)
    assert "decode kept" in res.output and "| kvserve | 8 | 1 |" in res.output
    assert "beside 1 spinning processes" in res.output and "load average" in res.output
    assert _spinners_of(os.getpid()) == []


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")
def test_llama_cpp_peer_under_the_same_load(tmp_path):
    res = CliRunner().invoke(app, ["latency", "-n", "8", "-m", "2", "--repeats", "1", "--busy-cores", "1",
                                   "--peer", "llama-cpp", "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    rows = [(r["engine"], r["busy_cores"]) for r in json.loads((tmp_path / "latency.json").read_text())]
    assert rows == [("kvserve", 0), ("kvserve", 1), ("llama.cpp", 0), ("llama.cpp", 1)]
