"""The model's tokenizer over HTTP (vLLM's routes), so a client needs only the server's URL.

    POST /tokenize        {prompt | messages, model?, add_special_tokens?, add_generation_prompt?,
                          return_token_strs?} -> {tokens, count, max_model_len, model, token_strs?}
    POST /detokenize      {tokens, model?} -> {prompt}
    GET  /tokenizer_info  the tokenizer's configuration as vLLM serves it (lm-eval's
                          `local-completions` with `tokenizer_backend=remote` never loads a local one)

Messages are rendered exactly as a chat request's are (context.template_messages, tools folded in).
`model` is resolved for the calling key as a generation's is: another key's LoRA adapter is the 404
of an unknown model (its tokenizer is the base's, but its name is not to be probed).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request

from kvserve.errors import InvalidRequest
from kvserve.server.generation.context import template_messages
from kvserve.server.protocol import DetokenizeRequest, TokenizeRequest, read_request
from kvserve.server.stages.tools import make_plan

if TYPE_CHECKING:
    from kvserve.server.state import ServerState


def mount_tokenizer(app: FastAPI, state: ServerState) -> None:
    settings = state.settings

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req = await read_request(request, TokenizeRequest, settings)
        engine, name = state.require_engine(req.model, request.state.record.key_name)
        tok = engine.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("Send exactly one of prompt or messages.", param="prompt")
        if req.messages is not None:
            msgs, tools = template_messages(tok, req.messages, make_plan(req.tools, "auto", None))
            text = await asyncio.to_thread(tok.apply_chat_template, msgs, tools=tools,
                                           add_generation_prompt=req.add_generation_prompt)
            ids = await asyncio.to_thread(tok.encode, text, add_special_tokens=False)
        else:
            ids = await asyncio.to_thread(tok.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        out = {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len, "model": name}
        if req.return_token_strs:
            out["token_strs"] = tok.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = await read_request(request, DetokenizeRequest, settings)
        engine, _ = state.require_engine(req.model, request.state.record.key_name)
        vocab = getattr(engine.tokenizer, "vocab_size", None)
        if any(t < 0 or (vocab is not None and t >= vocab) for t in req.tokens):
            raise InvalidRequest("tokens holds an id outside the vocabulary.", param="tokens")
        text = await asyncio.to_thread(engine.tokenizer.decode, req.tokens, skip_special_tokens=False)
        return {"prompt": text}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        engine, name = state.require_engine(None)
        tok = engine.tokenizer

        def text(token_id: int | None) -> str | None:
            return tok.convert_ids_to_tokens([token_id])[0] if token_id is not None else None

        return {"tokenizer_class": "PreTrainedTokenizerFast", "model": name,
                "model_max_length": engine.max_model_len, "vocab_size": getattr(tok, "vocab_size", None),
                "bos_token": text(tok.bos_token_id), "eos_token": text(tok.eos_token_id),
                "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                "pad_token": text(tok.eos_token_id), "add_bos_token": bool(getattr(tok, "add_bos", False)),
                "chat_template": tok.chat_template}
