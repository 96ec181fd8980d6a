"""Output moderation as a stage and the Responses context builder, without a model."""

from __future__ import annotations

import pytest

from kvserve.errors import InvalidRequest
from kvserve.safety import ModerationConfig
from kvserve.server.context import conversation
from kvserve.server.moderation import ModerationService
from kvserve.server.stages import ChoiceDelta


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    s = ModerationService(ModerationConfig(), tmp_path_factory.mktemp("mod") / "kvserve.db")
    yield s
    s.close()


def run(stage, words: list[str]) -> list[ChoiceDelta]:
    out = []
    for i, w in enumerate(words):
        d = stage.feed(ChoiceDelta(0, w, [i], finish_reason="length" if i == len(words) - 1 else None))
        out.append(d)
        if d.done:
            break
    return out


@pytest.mark.parametrize("every", [1, 4, 8])
def test_cut_within_one_window(service, every):
    cfg = ModerationConfig(check_every=every, blocklist={"places": ["zanzibar"]})
    words = [f"w{i} " for i in range(10)] + ["zanzibar "] + [f"x{i} " for i in range(30)]
    out = run(service.output_stage(cfg), words)
    assert out[-1].finish_reason == "content_filter" and out[-1].text == ""
    assert len(out) - 1 - 10 < every                 # cut within `every` tokens of the word


def test_clean_output_passes_and_is_redacted(service):
    stage = service.output_stage(ModerationConfig(check_every=2))
    text = "Write to bob@example.com or call +1 415-555-0134 today please ."
    out = run(stage, [w + " " for w in text.split()])
    sent = "".join(d.text for d in out)
    assert out[-1].finish_reason == "length"
    assert sent.split() == ["Write", "to", "[EMAIL]", "or", "call", "[PHONE]", "today", "please", "."]
    assert len(stage.checks) >= len(out) // 2 and not any(c["flagged"] for c in stage.checks)


def test_conversation_builder():
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    messages, new = conversation("Be brief.", history, items)
    assert messages[0] == {"role": "system", "content": "Be brief."} and messages[1:3] == history
    assert [m["role"] for m in new] == ["user", "assistant", "tool"]
    assert new[1]["tool_calls"][0]["function"]["name"] == "get_weather" and new[2]["tool_call_id"] == "c1"
    assert conversation(None, [], "hey")[0] == [{"role": "user", "content": "hey"}]
    with pytest.raises(InvalidRequest) as e:
        conversation(None, [], [{"type": "input_image"}])
    assert e.value.param == "input[0].type"
