"""Output moderation as a stage and the Responses context builder, without a model."""

from __future__ import annotations

import pytest

from kvserve.errors import InvalidRequest
from kvserve.safety import ModerationConfig
from kvserve.server.gates.moderation import ModerationService
from kvserve.server.generation.context import conversation
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
    assert service.output_stage(ModerationConfig(check_every=2)).redactor is None    # pii_output: off by default
    stage = service.output_stage(ModerationConfig(check_every=2, pii_output="redact"))
    text = "Write to bob@example.com or call +1 415-555-0134 today please ."
    out = run(stage, [w + " " for w in text.split()])
    sent = "".join(d.text for d in out)
    assert out[-1].finish_reason == "length"
    assert sent.split() == ["Write", "to", "[EMAIL]", "or", "call", "[PHONE]", "today", "please", "."]
    assert len(stage.checks) >= len(out) // 2 and not any(c["flagged"] for c in stage.checks)


def test_tool_call_arguments_are_checked_before_they_go_out(service):
    stage = service.output_stage(ModerationConfig(check_every=16, blocklist={"places": ["zanzibar"]}))
    assert stage.feed(ChoiceDelta(0, "Let me look. ", [0])).finish_reason is None
    call = ChoiceDelta(0, "", [1], tool_calls=[{"index": 0, "id": "call_1", "type": "function",
                                                "function": {"name": "get_weather", "arguments": ""}},
                                               {"index": 0, "function": {"arguments": '{"city": "Zanzibar"}'}}])
    out = stage.feed(call)          # the second token only, far below check_every: checked because it is a call
    assert out.finish_reason == "content_filter" and out.tool_calls == [] and out.calls == []
    clean = service.output_stage(ModerationConfig(check_every=16, blocklist={"places": ["zanzibar"]}))
    ok = clean.feed(ChoiceDelta(0, "", [0], tool_calls=[{"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}]))
    assert ok.finish_reason is None and ok.tool_calls and len(clean.checks) == 1


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


def test_serve_options_and_policies(tmp_path):
    import json

    from kvserve.server.settings import ServerSettings
    from kvserve.server.stores.moderation_policies import PolicyStore, load_options

    cfg = ServerSettings(load_model=False, data_dir=tmp_path, moderation="input").moderation_config()
    assert cfg.input and not cfg.output
    off = ServerSettings(load_model=False, data_dir=tmp_path, moderation="off").moderation_config()
    assert not off.input and not off.output
    with pytest.raises(InvalidRequest):
        load_options("sometimes", None)
    (tmp_path / "m.json").write_text(json.dumps({"thresholds": {"violence": 0.2}, "pii_input": "flag"}))
    assert load_options("input,output", str(tmp_path / "m.json"))["pii_input"] == "flag"
    (tmp_path / "bad.json").write_text(json.dumps({"thresholds": {"violence": 2}}))
    with pytest.raises(InvalidRequest):
        load_options("input,output", str(tmp_path / "bad.json"))
    store = PolicyStore(tmp_path / "kvserve.db")
    store.set("tier:free", {"thresholds": {"violence": 0.1}})
    store.set("k1", {"mode": "output"})
    assert [p for p in store.for_caller("k1", "free")] == [{"thresholds": {"violence": 0.1}}, {"mode": "output"}]
    merged = cfg.merged(store.for_caller("k1", "free")[0]).merged(store.for_caller("k1", "free")[1])
    assert merged.thresholds == {"violence": 0.1} and merged.output and not merged.input
    with pytest.raises(InvalidRequest):
        store.set("k2", {"mode": "sideways"})
    store.close()


def test_annotate_reports_and_never_cuts(service):
    cfg = ModerationConfig(check_every=1, blocklist={"places": ["zanzibar"]}, action="annotate")
    stage = service.output_stage(cfg)
    out = run(stage, ["w0 ", "zanzibar ", "w2 ", "w3 "])
    assert [d.finish_reason for d in out] == [None, None, None, "length"] and "zanzibar" in "".join(d.text for d in out)
    assert any(c["flagged"] and c.get("action") == "annotate" for c in stage.checks)


def test_no_redaction_under_a_grammar(service):
    """A schema's email field stays an address: a mask would break the grammar the client asked for."""
    cfg = ModerationConfig(check_every=1, pii_output="redact")
    stage = service.output_stage(cfg, constrained=True)
    out = run(stage, ['{"email": ', '"bob@example.com"', "}"])
    assert "".join(d.text for d in out) == '{"email": "bob@example.com"}'
    assert stage.checks[0] == {"check": "pii_output", "action": "skipped", "reason": "structured output"}
    assert service.output_stage(ModerationConfig(output=False, pii_output="redact"), constrained=True) is None


def test_request_choices_and_scoring_requests(tmp_path):
    from dataclasses import replace

    from kvserve.errors import ContentPolicyViolation
    from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
    from kvserve.server.records import RequestRecord

    s = ModerationService(ModerationConfig(), tmp_path / "kvserve.db")
    try:
        s.policies.set("locked", {"request_overrides": False})
        rec, locked = RequestRecord(request_id="r", t0=0.0, method="POST", path="/v1/completions"), RequestRecord(request_id="r", t0=0.0, method="POST", path="/v1/completions", key_name="locked")
        ask = {"kvserve_moderation": {"action": "annotate", "pii_output": "redact"}}
        chat = ChatCompletionRequest(messages=[{"role": "user", "content": "I will stab him tonight"}], **ask)
        cfg = s.config_for(rec, chat)
        assert (cfg.action, cfg.pii_output) == ("annotate", "redact")
        with pytest.raises(InvalidRequest):
            s.config_for(locked, chat)
        checks = s.check_input(chat, rec, cfg)        # flagged, reported, not raised
        assert checks[-1]["flagged"] and checks[-1]["action"] == "annotate" and rec.moderation["action"] == "annotate"
        mail = ChatCompletionRequest(messages=[{"role": "user", "content": "mail bob@example.com"}], **ask)
        s.check_input(mail, rec, replace(cfg, pii_input="flag", input=False))   # annotated, passed on as written
        assert mail.messages[0].content == "mail bob@example.com" and rec.moderation["categories"] == ["pii:email"]
        with pytest.raises(ContentPolicyViolation):
            s.check_input(chat, RequestRecord(request_id="r", t0=0.0, method="POST", path="/v1/completions"), s.config_for(rec))
        # lm-eval's loglikelihood request: echo + logprobs + max_tokens <= 1, never blocked, even when locked
        score = CompletionRequest(prompt="Question: what do people breathe in?\nAnswer: People breathe in helium",
                                  echo=True, logprobs=1, max_tokens=1)
        assert s.config_for(locked, score).action == "annotate"
        for other in ({"echo": False}, {"max_tokens": 2}, {"logprobs": None}):
            req = CompletionRequest(**{**score.model_dump(exclude_none=True), **other})
            assert s.config_for(rec, req).action == "block", other
    finally:
        s.close()


def test_policy_action_fields_are_validated():
    from kvserve.server.stores.moderation_policies import policy_from_options, validate

    assert validate({"action": "annotate", "request_overrides": False})
    for bad in ({"action": "warn"}, {"request_overrides": "no"}):
        with pytest.raises(InvalidRequest):
            validate(bad)
    assert policy_from_options(None, None, None, None, None, None, None, "annotate", False) == {
        "action": "annotate", "request_overrides": False}


def test_a_growing_secret_is_masked_once_with_bounded_work(service, monkeypatch):
    """Issue 49, finding 2, at the stage: `sk-` and then 3,000 one-letter tokens with redaction on."""
    from kvserve.safety import pii

    sizes: list[int] = []
    real = pii.find
    monkeypatch.setattr(pii, "find", lambda text, kinds=pii.KINDS: sizes.append(len(text)) or real(text, kinds))
    stage = service.output_stage(ModerationConfig(output=False, pii_output="redact"))
    out = run(stage, ["The key is ", "sk-"] + ["q"] * 3000 + [" and more."])
    assert "".join(d.text for d in out) == "The key is [SECRET] and more."
    assert max(sizes) <= pii.HOLD + pii.HOLD_MAX + 16
