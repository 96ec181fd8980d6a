"""Moderation policy rules: which overrides of `ModerationConfig` a policy (per key or tier, or the
server's `--moderation-config`) may hold, and the policy that `kvserve keys moderation` options
and `kvserve eval moderation` make. Stored by server/stores/moderation_policies.py."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from kvserve.errors import InvalidRequest
from kvserve.safety.moderator import MODES

FIELDS = {"mode", "thresholds", "blocklist", "regexes", "pii_input", "pii_output", "jailbreak", "check_every",
          "window_chars", "action", "request_overrides", "support_message"}


def validate(policy: dict[str, Any]) -> dict[str, Any]:
    """Raise InvalidRequest for an unknown field or value; returns the policy."""
    unknown = set(policy) - FIELDS
    if unknown:
        raise InvalidRequest(f"Unknown moderation policy field(s): {', '.join(sorted(unknown))}.", param="policy")
    if "mode" in policy and policy["mode"] not in MODES:
        raise InvalidRequest("mode must be input,output | input | output | off.", param="mode")
    if policy.get("pii_input", "off") not in ("off", "flag", "redact"):
        raise InvalidRequest("pii_input must be off, flag or redact.", param="pii_input")
    if policy.get("pii_output", "off") not in ("off", "redact"):
        raise InvalidRequest("pii_output must be off or redact.", param="pii_output")
    if policy.get("action", "block") not in ("block", "annotate"):
        raise InvalidRequest("action must be block or annotate.", param="action")
    if not isinstance(policy.get("request_overrides", True), bool):
        raise InvalidRequest("request_overrides must be true or false.", param="request_overrides")
    for cat, v in (policy.get("thresholds") or {}).items():
        if not isinstance(v, int | float) or not 0 <= v <= 1:
            raise InvalidRequest(f"The threshold of {cat} must be a number in [0, 1].", param="thresholds")
    if not isinstance(policy.get("support_message", ""), str) or len(policy.get("support_message", "")) > 2000:
        raise InvalidRequest("support_message must be a string of at most 2,000 characters.", param="support_message")
    if "check_every" in policy and (not isinstance(policy["check_every"], int) or policy["check_every"] < 1):
        raise InvalidRequest("check_every must be a positive number of tokens.", param="check_every")
    return policy


def _pairs(items: list[str] | None, what: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in items or []:
        cat, sep, value = item.partition("=")
        if not sep or not cat or not value:
            raise InvalidRequest(f"--{what} takes CATEGORY=VALUE, got {item!r}.", param=what)
        out.setdefault(cat, []).append(value)
    return out


def policy_from_options(mode: str | None, threshold: list[str] | None, block: list[str] | None,
                        regex: list[str] | None, pii_input: str | None, pii_output: str | None,
                        check_every: int | None, action: str | None = None,
                        request_overrides: bool | None = None) -> dict[str, Any]:
    """A policy from `kvserve keys moderation` options (only what was given)."""
    policy: dict[str, Any] = {}
    if mode is not None:
        policy["mode"] = mode
    if threshold:
        try:
            policy["thresholds"] = {c: float(v[-1]) for c, v in _pairs(threshold, "threshold").items()}
        except ValueError:
            raise InvalidRequest("--threshold takes CATEGORY=NUMBER.", param="threshold") from None
    if block:
        policy["blocklist"] = _pairs(block, "block")
    if regex:
        policy["regexes"] = _pairs(regex, "regex")
    if pii_input is not None:
        policy["pii_input"] = pii_input
    if pii_output is not None:
        policy["pii_output"] = pii_output
    if check_every is not None:
        policy["check_every"] = check_every
    if action is not None:
        policy["action"] = action
    if request_overrides is not None:
        policy["request_overrides"] = request_overrides
    return validate(policy)


def load_options(mode: str, config_file: str | None) -> dict[str, Any]:
    """`kvserve serve --moderation MODE --moderation-config FILE` as ModerationConfig overrides."""
    if mode not in MODES:
        raise InvalidRequest("--moderation must be input,output | input | output | off.", param="moderation")
    if not config_file:
        return {}
    try:
        options = json.loads(pathlib.Path(config_file).read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequest(f"--moderation-config {config_file}: {e}", param="moderation_config") from None
    if not isinstance(options, dict):
        raise InvalidRequest("--moderation-config must hold a JSON object.", param="moderation_config")
    options.pop("mode", None)
    return validate(options)
