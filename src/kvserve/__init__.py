"""kvserve: an LLM serving system in Python, from the HTTP gateway down to the paged KV cache."""

from kvserve.engine.llm import LLM
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]
