"""Where a request's own draft goes in a step (issue 47: the semantic cache's stored answer,
`EngineCoreRequest.draft_token_ids`), kept apart from the scheduler's budget and preemption logic.

A request's own draft rides on the step that computes its last known token, its prompt's last chunk
included, so the drafts are verified in the same forward as that token (spec_decode/rejection.py).
It takes the place of a proposer's (speculative decoding), and a request with its own draft still
pending is not offered to the proposer at all: the proposer (a draft model runs a forward per
proposal) would spend work on drafts that are thrown away, and the runner reads `Request.
supplied_draft` to know that a row's drafts are the request's own (its `draft_min_logprob` applies
to those only). Once the output leaves the supplied continuation (or it is used up) the request is
an ordinary decode again and the proposer may draft for it. A supplied draft's verification says
nothing about the proposer: the scheduler does not count it in the proposer's rates.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.engine.request import Request


def own_drafts(req: Request, start: int, n: int) -> list[int]:
    """The request's own drafts behind n tokens computed from `start`: only on the step that computes
    its last known token (nothing otherwise, or when it has none left)."""
    if req.supplied_draft is None or start + n != req.num_tokens:
        return []
    return req.supplied_drafts()


def has_own_draft(req: Request) -> bool:
    """The request still follows a continuation of its own (drops one that is used up or left)."""
    if req.supplied_draft is None:
        return False
    req.supplied_drafts()
    return req.supplied_draft is not None


def propose(spec, decodes: list[Request], cost) -> list[list[int]] | None:
    """The proposer's drafts for each running decode (None: no proposer, or it is off this step);
    a decode with its own draft pending gets none from it (module docstring)."""
    if spec is None or not spec.step_on(len(decodes)):
        return None
    asked = [i for i, r in enumerate(decodes) if not has_own_draft(r)]
    drafts: list[list[int]] = [[] for _ in decodes]
    if asked:
        for i, d in zip(asked, spec.propose([decodes[i] for i in asked], cost)):
            drafts[i] = d
    return drafts


def place(req: Request, start: int, n: int, proposed: Sequence[int], room: int) -> tuple[list[int], bool]:
    """The drafts behind n tokens of req from `start`, at most `room` of them: its own where
    `own_drafts` gives any, else the proposer's. Returns (drafts, whether they are the request's own)."""
    own = own_drafts(req, start, n)
    drafts = own or list(proposed)
    return drafts[:max(0, room)], bool(own)

