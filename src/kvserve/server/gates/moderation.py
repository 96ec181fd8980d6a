"""Moderation in the gateway: the service the server holds and the input gate.

* Input (before the queue): the request's user, system and tool text is checked (each message on
  its own, long ones in windows) and, with `pii_input`, searched for personal data. A flagged
  request is a 400 `content_policy_violation`: no token reservation, no admission slot, no engine
  request. It is counted in `kvserve:moderation_flagged_total{stage="input"}` and its verdict is
  written on the access-log line.
* Output: `output_stage` makes the last stage of every choice (stages/output_moderation.py).
* Per request the config is the server's (`--moderation`, `--moderation-config`) with the tier's
  and the key's stored policies on top (stores/moderation_policies.py), then the request's own
  `kvserve_moderation` (`action`, `pii_output`) when the policy allows it; a Moderator per distinct
  config is cached. Each check's time and verdict goes in `kvserve_trace.moderation`.
  `/v1/moderations` (api/moderations.py) runs the same moderators.
* Action `annotate` checks everything and blocks nothing: a flagged input goes on (its verdict in
  the access log, the trace, the `x-kvserve-moderation` header and
  `kvserve:moderation_annotated_total`), a flagged output window is traced and not cut. A scoring
  request (completions with echo and logprobs, max_tokens <= 1: how lm-eval measures a
  continuation's likelihood) is always annotated, never blocked: it generates at most one token,
  and what it echoes is the caller's own text.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvserve.errors import ContentPolicyViolation, InvalidRequest
from kvserve.safety import pii
from kvserve.safety.moderator import ModerationConfig, Moderator, Verdict
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.records import RequestRecord
from kvserve.server.routing.embedder import Embedder, QueryEmbedding
from kvserve.server.stages.output_moderation import OutputModerationStage
from kvserve.server.stores.moderation_policies import PolicyStore

if TYPE_CHECKING:
    from kvserve.tokenizer.tokenizer import Tokenizer

GenerationRequest = ChatCompletionRequest | CompletionRequest
CHUNK = 2000          # input text is checked in windows of this many characters
INLINE_CHARS = 4000   # input checked on the event loop up to this size, in a worker thread beyond


class ModerationService:
    """What the server holds for moderation: the base config, the policy store, moderators, metrics."""

    def __init__(self, config: ModerationConfig, db_path: pathlib.Path, registry: CollectorRegistry | None = None,
                 policies: PolicyStore | None = None):
        self.config = config
        self._owns_policies = policies is None   # the server passes its backends' store (and closes it)
        self.policies = policies if policies is not None else PolicyStore(db_path)
        self._moderators: dict[str, Moderator] = {}
        self.checks = Counter("kvserve:moderation_checks", "Moderation checks run, by stage.", ["stage"],
                              registry=registry)
        self.flagged = Counter("kvserve:moderation_flagged", "Inputs blocked and outputs cut, by stage and "
                               "category.", ["stage", "category"], registry=registry)
        self.seconds = Histogram("kvserve:moderation_check_seconds", "Time of one moderation check.", ["stage"],
                                 buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05), registry=registry)
        self.annotated = Counter("kvserve:moderation_annotated", "Flagged inputs and outputs let through "
                                 "(action annotate), by stage and category.", ["stage", "category"], registry=registry)

    def close(self) -> None:
        if self._owns_policies:
            self.policies.close()

    def config_for(self, record: RequestRecord, req: GenerationRequest | None = None) -> ModerationConfig:
        """The server's config, the caller's policies on top, then (given `req`) the request's own
        `kvserve_moderation` and the scoring-request rule (see the module's docstring)."""
        config = self.config
        for policy in self.policies.for_caller(record.key_name, record.key_tier if record.key else None):
            config = config.merged(policy)
        if req is None:
            return config
        spec = req.kvserve_moderation
        if spec is not None and (spec.action is not None or spec.pii_output is not None):
            if not config.request_overrides:
                raise InvalidRequest("This key's moderation policy cannot be changed per request; drop "
                                     "kvserve_moderation.", param="kvserve_moderation")
            config = replace(config, action=spec.action or config.action,
                             pii_output=spec.pii_output or config.pii_output)
        if is_scoring_request(req):
            config = replace(config, action="annotate")
        return config

    def moderator(self, config: ModerationConfig) -> Moderator:
        key = json.dumps([config.thresholds, config.blocklist, config.regexes, config.jailbreak], sort_keys=True)
        mod = self._moderators.get(key)
        if mod is None:
            if len(self._moderators) > 256:
                self._moderators.clear()
            mod = self._moderators[key] = Moderator(config)
        return mod

    def observe(self, stage: str, verdict: Verdict, action: str = "block") -> None:
        self.checks.labels(stage).inc()
        self.seconds.labels(stage).observe(verdict.elapsed_ms / 1000)
        if verdict.flagged:
            (self.annotated if action == "annotate" else self.flagged).labels(stage, verdict.top or "unknown").inc()

    # ---- input ----------------------------------------------------------------------------

    async def check_input_async(self, req: GenerationRequest, record: RequestRecord, config: ModerationConfig,
                                tokenizer: Tokenizer | None = None, embedder: Embedder | None = None,
                                shared: dict | None = None, skip: frozenset[int] = frozenset(),
                                pii: bool = True) -> list[dict[str, Any]]:
        """`check_input` with the embeddings it needs made on the shared encoder's thread
        (`embedder`, coalesced with the other requests' lookups). The last message's embedding
        is made as the semantic cache and the router make theirs (normalized text, full depth):
        it goes in `shared["query"]` so the request embeds it once. Without `embedder` (tests,
        benches) the moderator embeds on its own, in a worker thread. `skip`: the indices of
        messages the model will not read (dropped by `truncate: "oldest"`), not judged."""
        if has_token_prompts(req):
            texts = await asyncio.to_thread(input_texts, req, tokenizer)
        else:
            texts = input_texts(req, skip=skip)
        vectors: dict[int, Any] | None = None
        if config.input and embedder is not None and texts:
            mod = self.moderator(config)
            if mod.engine == "head":
                vectors = await self._embed(mod, texts, embedder, shared)
        if vectors is None and config.input:
            return await asyncio.to_thread(self.check_input, req, record, config, tokenizer, skip=skip, pii=pii)
        return self.check_input(req, record, config, tokenizer, vectors=vectors, skip=skip, pii=pii)

    @staticmethod
    async def _embed(mod: Moderator, texts: list[tuple[str, str, bool]], embedder: Embedder,
                     shared: dict | None) -> dict[int, Any]:
        import numpy as np

        from kvserve.safety.head import features
        from kvserve.safety.moderator import head_depths

        # the head's vectors: the shared embedding, the pooled states of more layers of the same
        # forward, or its tuned top layers' run on that forward (safety/head.py, safety/tuned.py)
        depths = await asyncio.to_thread(lambda: head_depths(embedder.get(), mod.head))
        wins = [mod.windows(t) for _, t, _ in texts]
        out: dict[int, Any] = {}
        last = len(texts) - 1
        if len(wins[last]) == 1:        # the query the cache and router embed too
            query = QueryEmbedding(wins[last][0])
            out[last] = (await query.features(embedder, "moderation", depths))[None, :]
            if shared is not None:
                shared["query"] = query
        rest = [(i, w) for i, ws in enumerate(wins) if i not in out for w in ws]
        if rest:
            vecs, _ = await embedder.encode_depths([w for _, w in rest], depths, use="moderation")
            joined = features(vecs, depths)
            for i in {i for i, _ in rest}:
                out[i] = np.stack([v for (j, _), v in zip(rest, joined) if j == i])
        return out

    def screen_pii(self, req: GenerationRequest, record: RequestRecord, config: ModerationConfig,
                   texts: list[tuple[str, str, bool]]) -> list[dict[str, Any]]:
        """The personal-data step of the input gate over `texts` (every message the client sent):
        flag (400), annotate, or redact the request in place. A chat fitted to the window before it is
        judged runs this first, so that the fit sees the redacted text (generation/plan.py)."""
        if config.pii_input == "off":
            return []
        t0 = time.perf_counter()
        kinds = sorted({m.kind for _, text, _ in texts for m in pii.find(text)})
        annotate = config.pii_input == "flag" and config.action == "annotate"
        entry = {"check": "pii_input", "kinds": kinds,
                 "action": ("annotate" if annotate else config.pii_input) if kinds else "none",
                 "ms": round((time.perf_counter() - t0) * 1000, 3)}
        if kinds and annotate:
            record.moderation = {"stage": "input", "flagged": True, "categories": [f"pii:{k}" for k in kinds],
                                 "action": "annotate"}
            self.annotated.labels("input", "pii").inc()
        elif kinds and config.pii_input == "flag":
            record.moderation = {"stage": "input", "flagged": True, "categories": [f"pii:{k}" for k in kinds]}
            self.flagged.labels("input", "pii").inc()
            raise ContentPolicyViolation(f"The request contains personal data or secrets ({', '.join(kinds)}); "
                                         "remove them and retry.", param="messages")
        if kinds and config.pii_input == "redact":
            redact_input(req)
        return [entry]

    def check_input(self, req: GenerationRequest, record: RequestRecord, config: ModerationConfig,
                    tokenizer: Tokenizer | None = None, vectors: dict[int, Any] | None = None,
                    skip: frozenset[int] = frozenset(), pii: bool = True) -> list[dict[str, Any]]:
        """Check a chat or completions request before it is queued; raise ContentPolicyViolation
        when flagged by a blocking category (self-harm never blocks: the verdict is logged and the
        answer gets the support message); redact personal data in place when configured.
        `vectors`: per input text, its windows' embeddings, when made already; `skip`: messages
        the model will not read (see `check_input_async`); `pii=False`: `screen_pii` ran already.
        Returns the trace entries."""
        texts = input_texts(req, tokenizer, skip)
        entries: list[dict[str, Any]] = []
        if pii and config.pii_input != "off":       # personal data on every message, dropped ones too
            entries = self.screen_pii(req, record, config, input_texts(req, tokenizer) if skip else texts)
            if entries[0]["action"] == "redact":
                texts = input_texts(req, tokenizer, skip)
        if not config.input:
            return entries
        mod = self.moderator(config)
        t0 = time.perf_counter()
        worst: Verdict | None = None
        where = None
        for n, (param, text, is_user) in enumerate(texts):
            if mod.engine == "head":        # windows of all of the text inside the check
                parts = [(text, None if vectors is None else vectors.get(n))]
            else:
                parts = [(text[max(0, i - 100):i + CHUNK], None) for i in range(0, max(len(text), 1), CHUNK)]
            for part, vecs in parts:
                v = mod.check(part, input=is_user, vectors=vecs)
                if worst is None or (v.flagged and not worst.flagged) or (v.blocking and not worst.blocking):
                    worst, where = v, param
                if v.blocking:
                    break
            if worst is not None and worst.blocking:
                break
        if worst is None:
            return entries
        worst.elapsed_ms = (time.perf_counter() - t0) * 1000
        self.observe("input", worst, config.action)
        annotated = {"action": "annotate"} if worst.flagged and config.action == "annotate" else {}
        if worst.flagged and not worst.blocking:      # self-harm or help-seeking: answered, logged, supported
            annotated = {"action": "support"}
            self.annotated.labels("input", worst.top or "self-harm").inc()
        entries.append({"check": "input", **worst.summary(), **annotated})
        if not (record.moderation and record.moderation.get("flagged")):   # a PII annotation stays
            record.moderation = {"stage": "input", **worst.summary(), **annotated}
        if worst.blocking and not annotated:
            cats = ", ".join(c for c, f in worst.categories.items() if f)
            raise ContentPolicyViolation(f"The request was flagged by input moderation ({cats}) and was not "
                                         "processed.", param=where)
        return entries

    # ---- output ---------------------------------------------------------------------------

    def output_stage(self, config: ModerationConfig, constrained: bool = False,
                     record: RequestRecord | None = None) -> OutputModerationStage | None:
        """The output stage of one choice. `constrained`: the text follows the request's grammar or
        schema, which a mask such as `[EMAIL]` could break, so nothing is redacted (the trace says so).
        `record`: the request's, whose input verdict says whether the support message goes first."""
        m = record.moderation if record is not None else None
        support = (config.support_message if config.support_message and not constrained and m
                   and m.get("action") == "support" else "")
        if not config.output and (config.pii_output == "off" or constrained) and not support:
            return None
        return OutputModerationStage(self.moderator(config) if config.output else None, config, self,
                                     redact=config.pii_output == "redact" and not constrained,
                                     skipped_redaction=config.pii_output == "redact" and constrained,
                                     support=support)


def is_scoring_request(req: GenerationRequest) -> bool:
    """lm-eval's loglikelihood shape: a completions request with echo and logprobs that generates
    at most one token."""
    if not isinstance(req, CompletionRequest) or not req.echo or req.logprobs is None:
        return False
    max_tokens = req.requested_max_tokens()
    return max_tokens is not None and max_tokens <= 1


def annotation_header(record: RequestRecord) -> dict[str, str]:
    """`x-kvserve-moderation` for an input flagged and let through (action annotate)."""
    m = record.moderation
    if not m or not m.get("flagged") or m.get("action") != "annotate":
        return {}
    return {"x-kvserve-moderation": "flagged; categories=" + ",".join(m.get("categories") or [])}


def has_token_prompts(req: GenerationRequest) -> bool:
    """A completions request whose prompt is token ids (a list of ints, or of lists of ints)."""
    prompt = getattr(req, "prompt", None)
    return isinstance(prompt, list) and any(isinstance(p, (int, list)) for p in prompt)


def input_texts(req: GenerationRequest, tokenizer: Tokenizer | None = None,
                skip: frozenset[int] = frozenset()) -> list[tuple[str, str, bool]]:
    """(param, text, written by the caller) for each piece of a request's input to check. Token-id
    prompts are checked as `tokenizer` decodes them (the text the model reads), when it is given.
    `skip`: indices of chat messages left out (ones the model will not read)."""
    if isinstance(req, ChatCompletionRequest):
        return [(f"messages[{i}]", m.text(), m.role in ("user", "system", "developer"))
                for i, m in enumerate(req.messages) if m.role != "assistant" and m.content and i not in skip]
    prompt = req.prompt
    if isinstance(prompt, str):
        return [("prompt", prompt, True)]
    if prompt and all(isinstance(p, int) for p in prompt):     # one prompt as token ids
        prompt = [prompt]
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append(("prompt", p, True))
        elif isinstance(p, list) and tokenizer is not None:
            # ids outside the vocabulary are left out here; the engine refuses them with a 400
            ids = [t for t in p if isinstance(t, int) and 0 <= t < tokenizer.vocab_size]
            out.append(("prompt", tokenizer.decode(ids, skip_special_tokens=False), True))
    return out


def redact_input(req: GenerationRequest) -> None:
    if isinstance(req, ChatCompletionRequest):
        for m in req.messages:
            if isinstance(m.content, str):
                m.content = pii.redact(m.content)
            elif m.content:
                for part in m.content:
                    part.text = pii.redact(part.text)
    elif isinstance(req.prompt, str):
        req.prompt = pii.redact(req.prompt)
    else:
        req.prompt = [pii.redact(p) if isinstance(p, str) else p for p in req.prompt]
