"""LLM: the offline Python API, vLLM-shaped.

    from kvserve import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct", kv_cache_memory="512MiB")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    outs[0].outputs[0].text
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.errors import InvalidRequest
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import load_model
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import Tokenizer


class LLM:
    def __init__(self, model: str | LlamaForCausalLM | None = None, *, tokenizer: Tokenizer | None = None,
                 weight_format: str = "auto", **engine_kwargs):
        """`model`: a built-in name, a .gguf file, a Hugging Face directory, or an in-memory
        LlamaForCausalLM (then pass its `tokenizer`). Engine options: see EngineConfig."""
        cfg = EngineConfig(weight_format=weight_format, **engine_kwargs)
        if isinstance(model, LlamaForCausalLM):
            if tokenizer is None:
                raise InvalidRequest("an in-memory model needs its tokenizer: LLM(model, tokenizer=...)",
                                     param="tokenizer")
            net, tok, name = model, tokenizer, model.config.name or "model"
        else:
            loaded = load_model(model, weight_format=weight_format)
            net, tok, name = loaded.model, loaded.tokenizer, loaded.source.name
        self.engine = LLMEngine(net, tok, cfg, model_name=name)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def stats(self) -> dict:
        return self.engine.stats()

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priority: Seq[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion, batched continuously; outputs in prompt order.
        A prompt is a string, a list of token ids, or {"prompt_token_ids": [...]}."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and
                                                isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._per_prompt(sampling_params, len(prompts))
        ids = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            rid = str(next(self._ids))
            self.engine.add_request(rid, p, sp, priority=priority[i] if priority else 0)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts = [{"prompt_token_ids": tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt,
                                                                 tokenize=True)} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _per_prompt(self, sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise InvalidRequest(f"got {len(sp)} SamplingParams for {n} prompts", param="sampling_params")
        return sp

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:                 # Ctrl-C or an error: leave the engine clean
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return [done[r] for r in ids]
