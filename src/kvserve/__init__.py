"""kvserve: an LLM serving system in Python, from the HTTP gateway down to the paged KV cache.

The public names are loaded on first use (PEP 562), so `import kvserve` (and its light modules:
errors, sampling_params, outputs) does not import torch; `from kvserve import LLM` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.engine.llm import LLM
    from kvserve.engine.lora import LoRARequest
    from kvserve.outputs import CompletionOutput, RequestOutput
    from kvserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "LoRARequest", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Plain import statements (not importlib with strings), so static import checks see them.
    if name == "LLM":
        from kvserve.engine import llm as module
    elif name == "LoRARequest":
        from kvserve.engine import lora as module
    elif name in ("CompletionOutput", "RequestOutput"):
        from kvserve import outputs as module
    elif name == "SamplingParams":
        from kvserve import sampling_params as module
    else:
        raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
    value = globals()[name] = getattr(module, name)     # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
