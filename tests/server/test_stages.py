"""The per-request stage list and the formatting at its end, without a model: deltas in, OpenAI
shapes out. The end-to-end behaviour is in test_openai_api.py and test_tool_calling.py."""

from __future__ import annotations

import json

from kvserve.outputs import Logprob
from kvserve.sampling_params import SamplingParams
from kvserve.server.api.openai_wire import OpenAIRenderer
from kvserve.server.generation import Generation, GenerationPlan, ModelHandle, Timings
from kvserve.server.generation.context import Prompt
from kvserve.server.records import GenerationLog, RequestRecord
from kvserve.server.stages import ChoiceDelta, build_stages, run_stages
from kvserve.server.stages.tools import make_plan, parse_output

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
PLAN = make_plan([WEATHER], "auto", None)
ANSWER = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'


def generation(plan=None, top: int | None = None, n: int = 1, include_usage: bool = False) -> Generation:
    return Generation.start(GenerationPlan(
        kind="chat", model=ModelHandle(None, "m"), prompts=[Prompt(token_ids=[1, 2, 3], text="hi")],
        params=SamplingParams(n=n, max_tokens=8), stages=lambda: build_stages(plan), timings=Timings(t0=0.0),
        top_logprobs=top, include_usage=include_usage))


def feed(gen: Generation, pieces: list[str]) -> list[ChoiceDelta]:
    ch = gen.prompts[0].choices[0]
    out = []
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        d = ChoiceDelta(0, text, [i], finish_reason="stop" if last else None)
        out.append(ch.add(run_stages(ch.stages, d)))
    return out


def test_no_stages_without_an_active_tool_plan():
    assert build_stages(None) == [] and build_stages(make_plan([WEATHER], "none", None)) == []
    assert len(build_stages(PLAN)) == 1


def test_tool_stage_streamed_equals_whole_text():
    gen = generation(PLAN)
    pieces = [ANSWER[i:i + 3] for i in range(0, len(ANSWER), 3)]
    deltas = feed(gen, pieces)
    ch = gen.prompts[0].choices[0]
    content, calls = parse_output(PLAN, "", ANSWER)
    assert ch.content == content == "Sure."
    assert [(c.name, c.arguments) for c in ch.calls] == [(c.name, c.arguments) for c in calls]
    assert ch.token_ids == list(range(len(pieces))) and ch.finish_reason == "stop"
    assert deltas[-1].calls == ch.calls and all(not d.calls for d in deltas[:-1])
    entries = [e for d in deltas for e in d.tool_calls]
    assert entries[0]["id"] == ch.calls[0].id and entries[0]["function"]["name"] == "get_weather"


def test_chunk_shapes():
    plain = OpenAIRenderer(generation(include_usage=True), decode=str)
    event = plain.choice(0, ChoiceDelta(0, "", [7]))
    body = json.loads(event[6:])
    assert body["choices"] == [{"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": None}]
    assert body["usage"] is None
    final = json.loads(plain.choice(1, ChoiceDelta(1, "", [], finish_reason="repetition", stop_reason=None))[6:])
    assert final["choices"][0] == {"index": 1, "delta": {}, "logprobs": None, "finish_reason": "stop",
                                   "stop_reason": None}
    tools = OpenAIRenderer(generation(PLAN), decode=str)
    assert tools.choice(0, ChoiceDelta(0, "", [7], filtered=True)) is None   # held back: nothing to send
    call = ChoiceDelta(0, "", [], finish_reason="stop", filtered=True, calls=[object()],
                       tool_calls=[{"index": 0, "function": {"arguments": "{}"}}])
    choice = json.loads(tools.choice(0, call)[6:])["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["delta"] == {"tool_calls": call.tool_calls}


def test_logprobs_keep_a_held_back_step():
    writer = OpenAIRenderer(generation(PLAN, top=1), decode=lambda t: f"<{t}>")
    d = ChoiceDelta(0, "", [7], logprobs=[{7: Logprob(-0.5, 1)}], filtered=True)
    choice = json.loads(writer.choice(0, d)[6:])["choices"][0]
    assert choice["delta"] == {} and choice["logprobs"]["content"][0]["token"] == "<7>"


def test_access_log_line_fields_in_order():
    rec = RequestRecord("rid", t0=0.0, method="POST", path="/v1/chat/completions", key_name="alice", status=200)
    rec.generation = GenerationLog("m", "chatcmpl-1", 3, 2, 0, "stop", 200, tool_calls=1,
                                   latency={"queue_ms": 1.0, "ttft_ms": 2.0, "tokens_per_s": None})
    line = json.loads(rec.access_log_line())
    assert list(line) == ["ts", "request_id", "method", "path", "status", "key_name", "model", "completion_id",
                          "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "request_status",
                          "tool_calls", "queue_ms", "ttft_ms", "tokens_per_s", "total_ms"]
    plain = RequestRecord("r2", t0=0.0, method="GET", path="/health")
    assert list(json.loads(plain.access_log_line())) == ["ts", "request_id", "method", "path", "status",
                                                          "key_name", "total_ms"]
