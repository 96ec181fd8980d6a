"""LLM: the offline Python API, vLLM-shaped.

    from kvserve import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct", kv_cache_memory="512MiB")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    outs[0].outputs[0].text
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from kvserve.engine.beam_search import BeamSearchParams, beam_search
from kvserve.engine.config import EngineConfig
from kvserve.engine.executor import load_engine_model
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.lora import LoRARequest
from kvserve.errors import InvalidRequest
from kvserve.model.decoder import DecoderLM
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import Tokenizer


class LLM:
    def __init__(self, model: str | DecoderLM | None = None, *, tokenizer: Tokenizer | None = None,
                 weight_format: str = "auto", **engine_kwargs):
        """`model`: a built-in name, a .gguf file, a Hugging Face directory, or an in-memory
        DecoderLM (then pass its `tokenizer`). Engine options: see EngineConfig."""
        cfg = EngineConfig(weight_format=weight_format, **engine_kwargs)
        if isinstance(model, DecoderLM):
            if tokenizer is None:
                raise InvalidRequest("an in-memory model needs its tokenizer: LLM(model, tokenizer=...)",
                                     param="tokenizer")
            net, tok, name = model, tokenizer, model.config.name or "model"
        else:
            loaded = load_engine_model(model, weight_format, cfg)
            net, tok, name = loaded.model, loaded.tokenizer, loaded.source.name
        self.engine = LLMEngine(net, tok, cfg, model_name=name)
        self._ids = itertools.count()
        self.last_aborted: RequestOutput | None = None

    def embed(self, texts: str | Seq[str]) -> list[list[float]]:
        """Sentence embeddings (all-MiniLM-L6-v2, 384 floats, unit length) of one text or a list,
        in input order: the server's /v1/embeddings encoder (kvserve.model.bert)."""
        from kvserve.model.bert import check_inputs, default_encoder

        items = [texts] if isinstance(texts, str) else list(texts)
        check_inputs(items)
        vecs, _ = default_encoder().encode(items)
        return vecs.tolist()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def stats(self) -> dict:
        return self.engine.stats()

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priority: Seq[int] | None = None,
                 lora_request: LoRARequest | str | Seq[LoRARequest | str | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion, batched continuously; outputs in prompt order.
        A prompt is a string, a list of token ids, or {"prompt_token_ids": [...]}.
        lora_request: the LoRA adapter of every prompt, or one per prompt (None: the base): a
        LoRARequest(name, id, path) (loaded at first use) or the name of one loaded already."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and
                                                isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._per_prompt(sampling_params, len(prompts))
        if any(p.use_beam_search for p in params):
            return self._beam_search(prompts, params)
        loras = self._loras(lora_request, len(prompts))
        ids = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            rid = str(next(self._ids))
            self.engine.add_request(rid, p, sp, priority=priority[i] if priority else 0, lora_name=loras[i])
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

    def add_lora(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter as `name` (InvalidRequest when it does not fit this base)."""
        self.engine.core.lora.add(name, path)

    def remove_lora(self, name: str) -> None:
        self.engine.core.lora.remove(name)

    def list_loras(self) -> list[str]:
        return self.engine.core.lora.names()

    def _loras(self, lr, n: int) -> list[str | None]:
        items = list(lr) if isinstance(lr, (list, tuple)) else [lr] * n
        if len(items) != n:
            raise InvalidRequest(f"got {len(items)} lora_requests for {n} prompts", param="lora_request")
        names: list[str | None] = []
        for item in items:
            if isinstance(item, LoRARequest):
                if item.lora_name not in self.engine.core.lora.paths and item.lora_path:
                    self.add_lora(item.lora_name, item.lora_path)
                item = item.lora_name
            names.append(item)
        return names

    def _per_prompt(self, sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise InvalidRequest(f"got {len(sp)} SamplingParams for {n} prompts", param="sampling_params")
        return sp

    def stream(self, prompt, sampling_params: SamplingParams | None = None, *,
               request_id: str | None = None) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding each RequestOutput as the engine produces it (read
        `outputs[i].text_delta` for the new text). Closing the iterator early (or Ctrl-C while
        iterating) aborts the request; its last output is then `self.last_aborted`."""
        rid = request_id or str(next(self._ids))
        self.engine.add_request(rid, prompt, sampling_params or SamplingParams())
        yield from self._drive([rid])

    def _drive(self, ids: list[str]) -> Iterator[RequestOutput]:
        """The one loop over engine steps: yields outputs of `ids` until all are finished; on any
        exit before that (an error, Ctrl-C, the consumer closing) the unfinished ones are aborted."""
        pending = set(ids)
        self.last_aborted: RequestOutput | None = None
        try:
            while pending and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            for rid in pending:             # Ctrl-C, an error or an early close: leave the engine clean
                self.last_aborted = self.engine.abort(rid) or self.last_aborted

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2) as bar:
            for out in self._drive(ids):
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        return [done[r] for r in ids]

    def _beam_search(self, prompts: list, params: list[SamplingParams]) -> list[RequestOutput]:
        """SamplingParams(use_beam_search=True): width best_of (or n), n best beams returned."""
        if any(p != params[0] for p in params):
            raise InvalidRequest("beam search takes one SamplingParams for all prompts", param="use_beam_search")
        p = params[0]
        ids = [self.engine.inputs.prompt_ids(x)[1] for x in prompts]
        bsp = BeamSearchParams.from_sampling_params(p, self.engine.max_model_len - max(map(len, ids)))
        results = beam_search(self, [{"prompt_token_ids": i} for i in ids], bsp)
        outs = []
        for x, r in zip(prompts, results):
            text = x if isinstance(x, str) else (x.get("prompt") if isinstance(x, dict) else None)
            comps = [CompletionOutput(index=j, text=s.text, token_ids=s.token_ids,
                                      cumulative_logprob=s.cumulative_logprob, finish_reason=s.finish_reason,
                                      logprobs=s.logprobs if p.logprobs is not None else None)
                     for j, s in enumerate(r.sequences[:p.n])]
            outs.append(RequestOutput(request_id=str(next(self._ids)), prompt=text,
                                      prompt_token_ids=r.prompt_token_ids, outputs=comps, finished=True))
        return outs
