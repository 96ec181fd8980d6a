"""The new families' chat-template idioms through the sandboxed Jinja path: Gemma's role
alternation check and `model` role, Phi-3's `<|end|>` turns, Mistral's [INST] with bos/eos,
Qwen3's namespace and reasoning stripping. The templates are written in the style of the ones those
models ship (tokenizer_config.json), kept short; a broken conversation is a 4xx-shaped error."""

from __future__ import annotations

import pytest

from kvserve.errors import InvalidRequest
from kvserve.tokenizer.chat_template import render_chat_template

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
QWEN3 = (
    "{%- set ns = namespace(last_user=-1) %}{%- for message in messages %}{%- if message.role == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- set content = message.content %}"
    "{%- if message.role == 'assistant' and '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- if loop.index0 > ns.last_user %}{%- set content = '<think>\\n' + reasoning + '\\n</think>\\n\\n' + content %}"
    "{%- endif %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")

CHAT = [{"role": "user", "content": "Hi "}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello"},
        {"role": "user", "content": [{"type": "text", "text": "Bye"}]}]


@pytest.mark.parametrize("template,want", [
    (GEMMA, ("<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n<think>\nhm\n</think>\n\nHello"
            "<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")),
    (PHI3, ("<|user|>\nHi <|end|>\n<|assistant|>\n<think>\nhm\n</think>\n\nHello<|end|>\n<|user|>\nBye<|end|>\n"
           "<|assistant|>\n")),
    (MISTRAL, "<bos>[INST] Hi  [/INST]<think>\nhm\n</think>\n\nHello</s>[INST] Bye [/INST]"),
    (QWEN3, ("<|im_start|>user\nHi <|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye"
            "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")),
])
def test_family_templates_render(template, want):
    got = render_chat_template(template, CHAT, add_generation_prompt=True, bos_token="<bos>", eos_token="</s>",
                               enable_thinking=False)
    assert got == want


@pytest.mark.parametrize("template", [GEMMA, MISTRAL])
def test_template_refusal_is_a_request_error(template):
    with pytest.raises(InvalidRequest, match="alternate|System role") as e:
        render_chat_template(template, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                             bos_token="<bos>", eos_token="</s>")
    assert e.value.param == "messages"
