"""SpecDecoder: the scheduler's side of speculative decoding. Which requests may speculate, with
how many draft tokens, and the counters the metrics read.

Adaptive k, per request: each request starts at the configured K; a step whose drafts were all
accepted raises its k by 2 (up to K), a rejection sets it to one more than what was accepted. A
running acceptance rate (exponential average of accepted / drafted) below `_OFF_RATE` switches
speculation off for that request for a cool-down number of steps (8, doubling on each relapse up
to 256), after which it tries again; drafts that do not pay therefore cost a few percent at most.
The n-gram proposer costs nothing when it finds no match, so only rejected drafts count. Under a
grammar (structured output) the drafts are cut where the request's matcher would refuse one.

For the whole step: once the step has `max_batch_rows` decoding rows or more, nobody speculates
(a batch that size is compute-bound on a CPU: the extra positions cost as much as they save).
Below that, a measured cost model decides per request: the scheduler's StepCostModel (step time
~ c0 + c_tok * tokens + c_row * rows, fitted on the steps run) gives a step of R single-token
decodes T0 = c0 + R (c_tok + c_row); a draft token adds c_tok to the step plus the proposer's own
time per draft token (c_prop, measured here) and yields a token with probability a (the request's
running acceptance rate). Throughput rises iff a > R (c_tok + c_prop) / T0, so a request drafts
only while its rate clears that bar (x `_MARGIN` for the verification's own overhead). On the
prior coefficients the bar is ~0.3 for one stream and ~0.7 at 8 rows.

Not eligible (they decode one token a step as before): requests that opted out
(`SamplingParams.speculative=False`), thinking requests (a reasoning budget), and
seeded sampled requests (their random stream, and therefore their tokens, must not depend on
whether the batch let them speculate).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvserve.engine.request import Request
from kvserve.engine.spec_decode.config import SpeculativeConfig
from kvserve.engine.spec_decode.proposer import NgramProposer, Proposer

_EMA = 0.3            # weight of the newest step in the running acceptance rate
_OFF_RATE = 0.25      # below this acceptance rate a request stops drafting for a while
_MIN_ROUNDS = 3       # ... judged only after this many drafting steps
_COOLDOWN0, _COOLDOWN_MAX = 8, 256
_MARGIN = 1.1         # the cost model's break-even acceptance rate, raised for verification overhead


@dataclass
class _ReqState:
    k: int
    rate: float = 0.6
    rounds: int = 0
    pause: int = 0               # steps left without drafting
    cooldown: int = _COOLDOWN0   # the next pause's length


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None):
        self.config = config
        self.proposer = proposer or NgramProposer(config.ngram_max, config.ngram_min)
        self.state: dict[str, _ReqState] = {}
        self.num_drafts = 0                 # verification rounds with at least one draft token
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # acceptance_length_counts[a]: rounds in which `a` drafts were accepted (0..K)
        self.acceptance_length_counts = [0] * (config.num_speculative_tokens + 1)
        self.proposer_s_per_token = 0.0     # running mean of the proposer's time per draft token

    @staticmethod
    def eligible(req: Request) -> bool:
        p = req.params
        return (p.speculative and (req.grammar_future is None or req.grammar is not None)
                and req.reasoning is None
                and (p.greedy or req.generator is None))

    def step_on(self, num_decodes: int) -> bool:
        cap = self.config.max_batch_rows
        return cap <= 0 or num_decodes < cap

    def break_even(self, num_decodes: int, cost=None) -> float:
        """The acceptance rate a draft token needs to pay in a step of `num_decodes` decodes."""
        if cost is None or self.config.max_batch_rows <= 0:
            return 0.0
        c0, c_tok, c_row = (float(c) for c in cost.coef[:3])
        t0 = c0 + num_decodes * (c_tok + c_row)
        return _MARGIN * num_decodes * (c_tok + self.proposer_s_per_token) / t0 if t0 > 0 else 0.0

    def propose(self, reqs: list[Request], cost=None) -> list[list[int]]:
        """Draft tokens for each running decode (empty for those that do not speculate now).
        `cost`: the scheduler's StepCostModel (None: no cost check)."""
        bar = self.break_even(len(reqs), cost)
        batch, idx = [], []
        for i, r in enumerate(reqs):
            if not self.eligible(r):
                continue
            st = self.state.get(r.request_id)
            if st is None:
                st = self.state[r.request_id] = _ReqState(self.config.num_speculative_tokens)
            if st.pause > 0:
                st.pause -= 1
                continue
            if st.rate < bar:          # does not pay in this step: wait, then try again from the bar
                st.pause, st.cooldown = st.cooldown, min(_COOLDOWN_MAX, st.cooldown * 2)
                st.rate, st.rounds = max(0.6, bar), 0
                continue
            room = (r.max_tokens if r.max_tokens is not None else 1 << 30) - len(r.output_token_ids) - 1
            k = min(st.k, room)
            if k > 0:
                batch.append((r, k))
                idx.append(i)
        drafts: list[list[int]] = [[] for _ in reqs]
        if not batch:
            return drafts
        t = time.perf_counter()
        proposed = self.proposer.propose(batch)
        n = sum(len(d) for d in proposed)
        if n:
            self.proposer_s_per_token += 0.2 * ((time.perf_counter() - t) / n - self.proposer_s_per_token)
        for i, d in zip(idx, proposed):
            g = reqs[i].grammar
            drafts[i] = d[:g.validate_tokens(d)] if g is not None and d else d   # drafts the grammar allows
        return drafts

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """A verification round's result: adapt the request's k and count it."""
        if num_drafted <= 0:
            return
        K = self.config.num_speculative_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.acceptance_length_counts[min(num_accepted, K)] += 1
        st = self.state.get(request_id)
        if st is None:
            return
        st.rounds += 1
        st.rate = (1 - _EMA) * st.rate + _EMA * num_accepted / num_drafted
        st.k = min(K, st.k + 2) if num_accepted == num_drafted else max(1, num_accepted + 1)
        if st.rounds >= _MIN_ROUNDS and st.rate < _OFF_RATE:
            st.pause, st.cooldown = st.cooldown, min(_COOLDOWN_MAX, st.cooldown * 2)
            st.rate, st.rounds, st.k = 0.6, 0, K

    def forget(self, request_id: str) -> None:
        self.state.pop(request_id, None)
        drop = getattr(self.proposer, "forget", None)
        if drop is not None:
            drop(request_id)

    def stats(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_acceptance_length_counts": list(self.acceptance_length_counts)}


def make_spec_decoder(config: SpeculativeConfig, model, tokenizer) -> SpecDecoder:
    """The decoder for an engine's target model (startup: errors here are one line, never mid-request)."""
    if config.method == "draft":   # an EAGLE head when the directory holds its fc (spec_decode/eagle.py)
        from pathlib import Path

        from kvserve.engine.spec_decode.draft import DraftProposer
        from kvserve.engine.spec_decode.eagle import EAGLE_FILE, EagleProposer
        cls = EagleProposer if (Path(config.draft_path) / EAGLE_FILE).is_file() else DraftProposer
        return SpecDecoder(config, cls.load(config, model, tokenizer))
    return SpecDecoder(config)
