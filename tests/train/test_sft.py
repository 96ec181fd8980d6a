import json
import re

import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequest
from kvserve.model.loader import load_model
from kvserve.train.sft import SFTConfig, encode_chat, format_mask, sft
from kvserve.train.tokenizer_train import load_tokenizer

WORDS = "apple river stone light house water bread night sword cloud field horse king gold tree fire sheep door city wind"
TRAIN_WORDS, HELD_WORDS = WORDS.split()[:15], WORDS.split()[15:]
FORMAT = re.compile(r"\[\[[a-z ]*\]\]")


def _chat(word: str) -> dict:
    return {"messages": [{"role": "system", "content": "Answer in brackets."},
                         {"role": "user", "content": f"Repeat: {word}"},
                         {"role": "assistant", "content": f"[[{word}]]"}]}


def test_mask_covers_exactly_the_assistant_replies(tok_dir):
    tok = load_tokenizer(tok_dir)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
                {"role": "user", "content": "and?"}, {"role": "assistant", "content": "bye"}]
    ids, mask = encode_chat(tok, messages)
    trained = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert trained == "hello there<|im_end|>bye<|im_end|>"
    # the sequence is the conversation rendered by the same chat template the server uses
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(messages, add_generation_prompt=False)
    shown = format_mask(tok, ids, mask)
    assert "«hello there<|im_end|>»" in shown and "«bye<|im_end|>»" in shown and "«hi" not in shown


def test_conversation_without_assistant_is_a_user_error(tok_dir):
    with pytest.raises(InvalidRequest, match="no assistant"):
        encode_chat(load_tokenizer(tok_dir), [{"role": "user", "content": "hi"}])


def _format_rate(model_dir) -> float:
    lm = load_model(str(model_dir), weight_format="fp32")
    llm = LLM(lm.model, tokenizer=lm.tokenizer, kv_cache_memory="16MiB")
    convs = [_chat(w)["messages"][:2] for w in HELD_WORDS]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return sum(bool(FORMAT.fullmatch(o.outputs[0].text)) for o in outs) / len(outs)


def test_sft_teaches_a_format_the_base_model_did_not_follow(base_run, tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(_chat(w)) + "\n" for w in TRAIN_WORDS * 4))
    r = sft(SFTConfig(model=base_run["out"], data=str(data), out=str(tmp_path / "sft"), epochs=12, batch_size=8,
                      lr=3e-3, debug=True))
    assert "«[[" in capsys.readouterr().out        # the debug print shows the mask
    losses = [h["loss"] for h in r["history"] if h["kind"] == "train"]
    assert losses[-1] < losses[0] / 4
    assert _format_rate(base_run["out"]) == 0.0
    assert _format_rate(tmp_path / "sft") >= 0.8   # held-out words, never seen in training
