"""LLMEngine: the synchronous driver (LLM.generate and the CLI): input processing, the EngineCore
in this thread, and output processing, with add_request / step / abort.

    step():  core.step() -> OutputProcessor -> RequestOutputs (requests whose text hit a stop
             string are aborted in the core right away)
"""

from __future__ import annotations

from kvserve.engine.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.processing import EngineInfo, EngineInfoView, InputProcessor, OutputProcessor
from kvserve.errors import InvalidRequest
from kvserve.model.decoder import DecoderLM
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import Tokenizer


class LLMEngine(EngineInfoView):
    def __init__(self, model: DecoderLM, tokenizer: Tokenizer, config: EngineConfig | None = None,
                 model_name: str = ""):
        self.config = config = config or EngineConfig()
        self.core = EngineCore(model, config, tokenizer.eos_token_ids, tokenizer)
        self.tokenizer = tokenizer
        self.info = EngineInfo(model_name or model.config.name, self.core.max_model_len, config.block_size,
                               model.config.vocab_size, self.core.context_limited_by_kv)
        self.inputs = InputProcessor(tokenizer, self.info, config.enable_prefix_caching)
        self.outputs = OutputProcessor(tokenizer)

    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    *, priority: int = 0, cache_salt: str | None = None, lora_name: str | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.outputs.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        text, ids = self.inputs.prompt_ids(prompt)
        if lora_name is not None and lora_name not in self.core.lora.paths:
            self.core.lora.acquire(lora_name)   # raises ModelNotFound
        reqs = self.inputs.requests(request_id, ids, params, priority=priority, cache_salt=cache_salt,
                                    lora_name=lora_name)
        self.outputs.add(request_id, text, reqs)
        for r in reqs:
            self.core.add_request(r)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free all its blocks at once."""
        self.core.abort_requests(self.outputs.core_ids(request_id))
        return self.outputs.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outs, to_abort = self.outputs.process(self.core.step())
        if to_abort:
            self.core.abort_requests(to_abort)
        for out in outs:
            if out.error is not None:
                raise RuntimeError(out.error)
        return outs

    def stats(self) -> dict:
        return self.core.stats()
