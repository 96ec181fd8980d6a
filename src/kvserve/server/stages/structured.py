"""The request's structured-output fields, as one StructuredOutputsParams (or None).

OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema"}), vLLM's request
extras (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, `structured_outputs`)
and a forced or automatic tool call (kvserve.server.stages.tools.ToolPlan.structured) all become the
same thing: one grammar for the engine (kvserve.structured). At most one of them may be given;
`param` names the field errors point at, so a bad schema's 400 names `response_format...`.
"""

from __future__ import annotations

from typing import Any

from kvserve.errors import InvalidRequest
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.server.stages.tools import CLOSE, OPEN, ToolPlan
from kvserve.structured.tool_grammar import tool_call_grammar

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def from_request(req: Any) -> tuple[StructuredOutputsParams, str] | None:
    """(spec, the field it came from) for a parsed chat or completion request, or None."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    rf = req.response_format
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            found.append(spec)
    for name, kind in GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append((_make(name, **{kind: value}), name))
    if req.structured_outputs is not None:
        if not isinstance(req.structured_outputs, dict):
            raise InvalidRequest("structured_outputs must be an object.", param="structured_outputs")
        unknown = set(req.structured_outputs) - {"json", "regex", "choice", "grammar", "json_object"}
        if unknown:
            raise InvalidRequest(f"Unrecognized structured_outputs field {min(unknown)!r}; use one of "
                                 "json, regex, choice, grammar, json_object.", param="structured_outputs")
        found.append((_make("structured_outputs", **req.structured_outputs), "structured_outputs"))
    if len(found) > 1:
        raise InvalidRequest(f"Give one output constraint, not {len(found)} ({', '.join(p for _, p in found)}).",
                             param=found[1][1])
    return found[0] if found else None


def _make(param: str, **kw) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kw)
    except InvalidRequest as e:
        raise InvalidRequest(e.message.replace("structured_outputs", param), param=param) from None


def _response_format(rf: dict) -> tuple[StructuredOutputsParams, str] | None:
    kind = rf.get("type")
    if kind == "text":
        _only(rf, {"type"})
        return None
    if kind == "json_object":
        _only(rf, {"type"})
        return StructuredOutputsParams(json_object=True), "response_format"
    if kind == "json_schema":
        _only(rf, {"type", "json_schema"})
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise InvalidRequest("response_format json_schema needs a json_schema object with a name and a schema.",
                                 param="response_format.json_schema")
        unknown = set(js) - {"name", "schema", "strict", "description"}
        if unknown:
            raise InvalidRequest(f"Unrecognized request argument supplied: response_format.json_schema."
                                 f"{min(unknown)}.", param=f"response_format.json_schema.{min(unknown)}")
        if not isinstance(js.get("name"), str) or not js["name"]:
            raise InvalidRequest("response_format.json_schema.name is required (a string).",
                                 param="response_format.json_schema.name")
        if not isinstance(js.get("schema"), dict):
            raise InvalidRequest("response_format.json_schema.schema must be a JSON schema object.",
                                 param="response_format.json_schema.schema")
        return StructuredOutputsParams(json=js["schema"]), "response_format.json_schema.schema"
    raise InvalidRequest(f"Invalid value for response_format.type: {kind!r}. Use \"text\", \"json_object\" or "
                         "\"json_schema\".", param="response_format.type")


def _only(rf: dict, keys: set[str]) -> None:
    extra = set(rf) - keys
    if extra:
        name = min(extra)
        raise InvalidRequest(f"Unrecognized request argument supplied: response_format.{name}.",
                             param=f"response_format.{name}")


def for_request(req: Any, plan: ToolPlan | None) -> tuple[StructuredOutputsParams, str] | None:
    """The request's one constraint: its structured-output field, else its tool plan's grammar
    (a forced call, or the lazy grammar of "auto"; only when llguidance is installed)."""
    found = from_request(req)
    if plan is None or not plan.active:
        return found
    forced = plan.choice in ("named", "required")
    if found is not None:
        if forced:
            raise InvalidRequest(f"{found[1].split('.')[0]} cannot be combined with a forced tool_choice.",
                                 param=found[1].split(".")[0])
        return found        # "auto" with an output format: the format wins
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return None         # tools still work, unconstrained
    grammar = tool_call_grammar(plan.tools, plan.choice, plan.forced_name, plan.parallel, OPEN, CLOSE)
    return (StructuredOutputsParams(grammar=grammar), "tools") if grammar else None
