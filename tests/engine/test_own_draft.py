"""engine/own_draft.py without a model: a request's own draft goes only on the step that computes
its last known token, takes the proposer's place, is cut to the room left, and keeps the request
away from the proposer while it is pending (and only then)."""

from __future__ import annotations

from kvserve import SamplingParams
from kvserve.engine import own_draft
from kvserve.engine.messages import EngineCoreRequest
from kvserve.engine.request import Request


def request(rid: str, draft: list[int] | None, max_tokens: int = 10) -> Request:
    core = EngineCoreRequest(request_id=rid, prompt_token_ids=[1, 2, 3, 4], arrival_time=0.0,
                             sampling_params=SamplingParams(max_tokens=max_tokens), draft_token_ids=draft)
    return Request.from_core_request(core, 0, 100)


class Spec:
    """A proposer that drafts [9, 9] for whoever it is asked about."""

    def __init__(self, on: bool = True):
        self.on, self.asked = on, []

    def step_on(self, num_decodes: int) -> bool:
        return self.on

    def propose(self, reqs, cost=None):
        self.asked += [r.request_id for r in reqs]
        return [[9, 9] for _ in reqs]


def test_placement_on_the_last_known_token_only_and_cut_to_the_room():
    r = request("a", [5, 6, 7])
    assert own_draft.place(r, 0, 2, [9], room=10) == ([9], False)       # a middle chunk: the proposer's
    assert own_draft.place(r, 0, 4, [9], room=10) == ([5, 6, 7], True)  # the prompt's last chunk: its own
    assert own_draft.place(r, 0, 4, (), room=2) == ([5, 6], True)
    assert own_draft.place(request("b", None), 0, 4, [9], room=1) == ([9], False)


def test_proposer_not_asked_while_an_own_draft_is_pending():
    own, plain = request("own", [5, 6, 7]), request("plain", None)
    spec = Spec()
    assert own_draft.propose(spec, [own, plain], None) == [[], [9, 9]] and spec.asked == ["plain"]
    own.output_token_ids = [5, 8]                   # left the draft: an ordinary decode again
    assert own_draft.propose(spec, [own, plain], None) == [[9, 9], [9, 9]] and own.supplied_draft is None
    assert own_draft.propose(Spec(on=False), [own], None) is None and own_draft.propose(None, [own], None) is None
