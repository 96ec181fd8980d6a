"""Tokenizer: HF `tokenizers` underneath, built from a tokenizer.json or from GGUF metadata.

From GGUF (`tokenizer.ggml.*`: the byte-level BPE "gpt2" model or SentencePiece "llama") we
rebuild the tokenizers pipeline that tokenizes as llama.cpp does on the same file
(`gguf_vocab.py`), with the control tokens as special added tokens matched whole in text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from kvserve.errors import ModelLoadError
from kvserve.tokenizer import gguf_vocab
from kvserve.tokenizer.chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    RAW_COMPLETION_TEMPLATE,
    render_chat_template,
    template_variables,
)

# Tokens that end an assistant turn in common chat formats; any present in the vocabulary
# also stops generation.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>",
                      "<|end|>", "</s>")

def gguf_field(reader, key: str, default=None):
    """One metadata value of a gguf.GGUFReader (the model loader reads its fields with this too)."""
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:  # noqa: BLE001 - any decoding failure means a corrupt field
        raise ModelLoadError(f"GGUF metadata field {key} is corrupt") from None


class Tokenizer:
    def __init__(self, hf: HFTokenizer, *, bos_token_id: int | None, eos_token_ids: Sequence[int],
                 add_bos: bool = False, add_eos: bool = False, chat_template: str | None = None):
        self.hf = hf
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        dec = hf.decoder.__getstate__() if hf.decoder is not None else b""
        self._strips_first_space = b'"type":"Strip"' in dec
        # llama.cpp's own SPM encoder where the BPE in `hf` cannot equal it (gguf_vocab.exact_spm_encoder)
        self.exact_encoder = None
        self.chat_template = chat_template or DEFAULT_CHAT_TEMPLATE
        self.has_chat_template = chat_template is not None
        vocab = hf.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.all_special_ids: set[int] = {t_id for t_id, t in hf.get_added_tokens_decoder().items() if t.special}
        eos = list(dict.fromkeys(eos_token_ids))
        for tok in END_OF_TURN_TOKENS:
            tid = vocab.get(tok)
            if tid is not None and tid in self.all_special_ids and tid not in eos:
                eos.append(tid)
        self.eos_token_ids: list[int] = eos
        self.eos_token_id = eos[0] if eos else None

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, reader, hf: HFTokenizer | None = None) -> Tokenizer:
        """From the tokenizer.ggml.* metadata of a gguf.GGUFReader; `hf`: the BPE built from it
        before (the model loader caches it: a 128k vocabulary's build costs about a second)."""

        def field(key: str, default=None):
            return gguf_field(reader, key, default)

        spm = field("tokenizer.ggml.model") == "llama"
        if hf is None:
            hf = cls.hf_from_gguf(reader)
        # llama.cpp's defaults for a SentencePiece vocabulary that does not say: <s>=1, </s>=2, add BOS
        bos = field("tokenizer.ggml.bos_token_id", 1 if spm else None)
        eos = field("tokenizer.ggml.eos_token_id", 2 if spm else None)
        tok = cls(hf, bos_token_id=None if bos is None else int(bos),
                  eos_token_ids=[] if eos is None else [int(eos)],
                  add_bos=bool(field("tokenizer.ggml.add_bos_token", spm)),
                  add_eos=bool(field("tokenizer.ggml.add_eos_token", False)),
                  chat_template=field("tokenizer.chat_template"))
        if spm:
            tok.exact_encoder = gguf_vocab.exact_spm_encoder(field)
            if not tok.has_chat_template and "<|im_start|>" not in hf.get_vocab():
                tok.chat_template = RAW_COMPLETION_TEMPLATE    # not ChatML its vocabulary cannot spell
        return tok

    @staticmethod
    def hf_from_gguf(reader) -> HFTokenizer:
        """The `tokenizers` pipeline of a GGUF file's tokenizer (byte-level BPE or SentencePiece;
        `gguf_vocab.py` says how each maps): the model loader caches it."""
        return gguf_vocab.hf_from_gguf(lambda key, default=None: gguf_field(reader, key, default))


    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ModelLoadError(f"{path} has no tokenizer.json")
        try:
            hf = HFTokenizer.from_file(str(tj))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise ModelLoadError(f"{tj} cannot be read ({e})") from None
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        model_cfg = _read_json(path / "config.json")

        def tok_id(v) -> int | None:
            if isinstance(v, dict):
                v = v.get("content")
            return hf.token_to_id(v) if isinstance(v, str) else None

        eos: list[int] = []
        for src in (gen.get("eos_token_id"), model_cfg.get("eos_token_id")):
            eos += src if isinstance(src, list) else [src] if isinstance(src, int) else []
        if (t := tok_id(cfg.get("eos_token"))) is not None:
            eos.append(t)
        bos = tok_id(cfg.get("bos_token"))
        if bos is None:
            bos = model_cfg.get("bos_token_id")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        return cls(hf, bos_token_id=bos, eos_token_ids=eos, add_bos=False, chat_template=template)

    # ---- encoding -----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.exact_encoder is not None:
            ids = self.exact_encoder.encode(text)
        else:
            ids = self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and (
                not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        if add_special_tokens and self.add_eos and self.eos_token_id is not None:
            ids = ids + [self.eos_token_id]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.hf.id_to_token(int(i)) or "" for i in ids]

    def token_text(self, token_id: int) -> str:
        """The text one token stands for on its own (may be a partial UTF-8 character: '�'), with
        its leading space (a SentencePiece decoder drops the space of a text's first piece)."""
        text = self.hf.decode([int(token_id)], skip_special_tokens=False)
        if self._strips_first_space and (self.hf.id_to_token(int(token_id)) or "").startswith("\u2581"):
            text = " " + text
        return text

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tool definitions itself (reads a `tools` variable)."""
        return "tools" in template_variables(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, tools: list[dict] | None = None,
                            **kwargs) -> str | list[int]:
        text = render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt, tools=tools,
            bos_token=self.hf.id_to_token(self.bos_token_id) if self.bos_token_id is not None else "",
            eos_token=self.hf.id_to_token(self.eos_token_id) if self.eos_token_id is not None else "",
            **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _read_json(p: Path) -> dict:
    if not p.is_file():
        return {}
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{p} is not valid JSON ({e})") from None
