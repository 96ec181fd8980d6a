"""Speculative decoding: a cheap proposer guesses the next k tokens of a decoding request, the target
model scores all of them in the same step, and rejection sampling keeps exactly the target's output
distribution.

    Scheduler.schedule()   SpecDecoder.propose: drafts for each eligible decode (the request's own
                           adaptive k, nothing when the step is big enough to be compute-bound),
                           scheduled as 1 + k new tokens in `ScheduledRequest.spec_token_ids`
    ModelRunner.execute()  the k + 1 positions go through the forward and the lm head; `verify`
                           (rejection.py) keeps the accepted drafts plus one token of the target's
    Scheduler.update_from_output()
                           num_computed_tokens advances over the real token and the accepted drafts
                           only; the KV slots of rejected drafts are overwritten by the next step
                           (their blocks past the sequence are freed), and only blocks of verified
                           tokens are ever hashed into the prefix cache

A request may also bring its own draft (`EngineCoreRequest.draft_token_ids`: the semantic cache's
stored answer, docs/routing.md): the scheduler puts it behind the step that computes the request's
last known token, its prompt's last chunk included (`ScheduledRequest.supplied_draft`; the placement
is engine/own_draft.py), in place of any proposer's, and the same `verify` keeps what the target
agrees with (a sampled request by likelihood when it brings `draft_min_logprob`). It needs no
proposer, is not counted in the proposer's rates, and is dropped at the first token that differs;
while it is pending the proposer is not asked for that request.

Modules: `config.py` (what the user asked for, checked at startup), `proposer.py` (the `Proposer`
interface and the n-gram prompt-lookup proposer), `draft.py` (the draft-model proposer, its own
dense KV cache per request), `rejection.py` (verification, greedy and sampled), `decoder.py`
(per-request adaptive k, the cost-model and step on/off switches, the counters).
"""

from kvserve.engine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
