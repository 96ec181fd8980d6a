"""The chat-template sandbox's cost limits: a template from a model file cannot make a render
take unbounded memory or time; each limit is a 400 (InvalidRequest, param "messages")."""

from __future__ import annotations

import pytest

from kvserve.errors import InvalidRequest
from kvserve.tokenizer import chat_template
from kvserve.tokenizer.chat_template import render_chat_template

MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("template", [
    "{{ 'a' * 10**9 }}",
    "{{ 10**9 * 'a' }}",
    "{{ ['a'] * 10**9 }}",
    "{{ 2 ** 100000 }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ 'abcdefgh' }}{% endfor %}{% endfor %}",
])
def test_huge_outputs_are_refused(template):
    with pytest.raises(InvalidRequest) as e:
        render_chat_template(template, MSGS)
    assert e.value.param == "messages"


def test_slow_templates_hit_the_deadline(monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_TIMEOUT_S", 0.2)
    busy = "{% for i in range(100000) %}{% for j in range(100000) %}{% set x = i + j %}{% endfor %}{% endfor %}"
    with pytest.raises(InvalidRequest, match="to render"):
        render_chat_template(busy, MSGS)


def test_ordinary_templates_still_render():
    out = render_chat_template(chat_template.DEFAULT_CHAT_TEMPLATE, MSGS * 3, add_generation_prompt=True)
    assert out.count("<|im_start|>user\nhi<|im_end|>") == 3 and out.endswith("<|im_start|>assistant\n")
    assert render_chat_template("{{ 'ab' * 3 }}{{ 2 ** 10 }}{{ 1 + 2 }}", MSGS) == "ababab10243"
