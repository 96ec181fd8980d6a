"""Write a SentencePiece vocabulary into a GGUF file as llama.cpp's converter does.

`add_sentencepiece_vocab(writer, "tokenizer.model")` puts the `tokenizer.ggml.*` fields that
llama.cpp's convert_hf_to_gguf.py `_set_vocab_sentencepiece` writes: model `llama`, pre
`default`, every piece with its score and type (NORMAL, UNKNOWN, CONTROL, UNUSED, BYTE; the
proto's user-defined pieces as USER_DEFINED, as the converter marks a tokenizer_config's added
tokens), `add_space_prefix` from the model's `add_dummy_prefix`, and the bos/eos/unk/pad ids.
Random-weight model files (`gguf_random.py`) and the tokenizer tests use it.
"""

from __future__ import annotations

from pathlib import Path

from kvserve.model.gguf_write import finish

# gguf.TokenType values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def sentencepiece_vocab(model_path: str | Path) -> dict:
    """The vocabulary fields of a SentencePiece model: tokens, scores, types, add_space_prefix
    and the special ids (None where the model has none)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_path).read_bytes())
    user_defined = sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.IdToPiece(i))
        scores.append(float(sp.GetScore(i)))
        if sp.IsUnknown(i):
            t = UNKNOWN
        elif sp.IsControl(i):
            t = CONTROL
        elif sp.IsUnused(i):
            t = UNUSED
        elif sp.IsByte(i):
            t = BYTE
        elif proto.pieces[i].type == user_defined:
            t = USER_DEFINED
        else:
            t = NORMAL
        types.append(t)

    def opt(i: int) -> int | None:
        return i if i >= 0 else None

    return {"tokens": tokens, "scores": scores, "types": types,
            "add_space_prefix": bool(proto.normalizer_spec.add_dummy_prefix),
            "bos": opt(sp.bos_id()), "eos": opt(sp.eos_id()), "unk": opt(sp.unk_id()), "pad": opt(sp.pad_id())}


def add_sentencepiece_vocab(writer, model_path: str | Path, *, add_bos: bool = True, add_eos: bool = False,
                            add_space_prefix: bool | None = None, chat_template: str | None = None,
                            pre: str = "default") -> int:
    """Add the SentencePiece model's vocabulary to a gguf.GGUFWriter; returns its size.
    `add_space_prefix` None: the model's own `add_dummy_prefix` (Gemma's files say False)."""
    v = sentencepiece_vocab(model_path)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([t.encode("utf-8") for t in v["tokens"]])
    writer.add_token_scores(v["scores"])
    writer.add_token_types(v["types"])
    writer.add_add_space_prefix(v["add_space_prefix"] if add_space_prefix is None else add_space_prefix)
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if v[key] is not None:
            add(v[key])
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    if chat_template:
        writer.add_chat_template(chat_template)
    return len(v["tokens"])


def write_vocab_only(path: str | Path, model_path: str | Path, *, arch: str = "llama", name: str = "vocab-only",
                     **kwargs) -> Path:
    """A GGUF holding only a SentencePiece vocabulary (what `Llama(..., vocab_only=True)` reads);
    `name`: general.name (llama.cpp strips whitespace after special tokens for a "phi-3" one)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    add_sentencepiece_vocab(w, model_path, **kwargs)
    finish(w)
    return Path(path)
