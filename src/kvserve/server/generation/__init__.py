"""One generation path for every API: a typed plan, a lease, a run, and the API's renderer.

    plan.py   build_plan(gw, record, req, kind) → GenerationPlan: the gates, once per request
    lease.py  Lease.acquire → `async with lease:` holds the token reservation, the admission slot
              and the engine requests, and gives them back exactly once
    run.py    run_generation(gw, gen, lease) → ChoiceEvent stream (engine client or cached answer,
              each choice through its stage list); run_to_end for an answer that does not stream
    state.py  Generation: the plan and the choices accumulated from the run (usage, log entry)
    engine.py ModelHandle: every call the gateway makes on an EngineClient
    trace.py  kvserve_trace

An API (server/api/) parses its body into a chat or completions request, and renders the events
and the Generation in its own wire format; nothing goes back through HTTP text.
"""

from kvserve.server.generation.engine import ModelHandle
from kvserve.server.generation.lease import ClientGone, Lease, until_disconnected
from kvserve.server.generation.plan import (
    CACHE_HEADER,
    CAP_HEADER,
    TRUNCATED_HEADER,
    GenerationPlan,
    Kind,
    Timings,
    build_plan,
)
from kvserve.server.generation.run import ChoiceEvent, run_generation, run_to_end
from kvserve.server.generation.state import ChoiceState, Generation, PromptState, Usage
from kvserve.server.generation.trace import TokenTexts, request_trace

__all__ = ["CACHE_HEADER", "CAP_HEADER", "TRUNCATED_HEADER", "ChoiceEvent", "ChoiceState", "ClientGone",
           "Generation", "GenerationPlan", "Kind", "Lease", "ModelHandle", "PromptState", "Timings", "TokenTexts",
           "Usage", "build_plan", "request_trace", "run_generation", "run_to_end", "until_disconnected"]
