"""SpecDecoder: the scheduler's side of speculative decoding. Which requests may speculate, with
how many draft tokens, and the counters the metrics read.

Adaptive k, per request: each request starts at the configured K; a step whose drafts were all
accepted raises its k by 2 (up to K), a rejection sets it to one more than what was accepted. A
running rate of accepted first drafts below `_OFF_RATE` switches speculation off for that request
for a cool-down number of steps (8, doubling on each relapse up to 256, and back to 8 once it has
drafted `_SETTLED` rounds in a row), after which it tries again; drafts that do not pay therefore
cost a few percent at most. The rate is a mean over the request's first rounds (with `_PRIOR`
rounds at its starting rate), then an exponential average with weight `_EMA`: a head right half
the time must not be paused by a run of four misses (it was, at weight 0.3, and the doubling
pauses left e4's open prompts drafting in 40% of their steps: 1.05x; now 75%, 1.10-1.13x).
The n-gram proposer costs nothing when it finds no match, so only rejected drafts count. Under a
grammar (structured output) the drafts are cut where the request's matcher would refuse one.

For the whole step: once the step has `max_batch_rows` decoding rows or more, nobody speculates
(a batch that size is compute-bound on a CPU: the extra positions cost as much as they save).
Below that, a measured cost model decides per request and per draft position: the scheduler's
StepCostModel (step time ~ c0 + c_tok * tokens + c_row * rows + c_att * attention, fitted on the
steps run) gives a step of R single-token decodes T0; a draft token at context c adds c_tok +
c_att * c (its verification row attends to the whole context) plus the proposer's own time per
draft token (c_prop: the median of recent calls in which every request drafted in its step
before as well, since a first round also runs a draft model over the positions it skipped, which
a request that keeps drafting does not pay again), and yields a token if it and every draft
before it are accepted. The i-th draft token therefore pays iff
P(drafts 1..i accepted) > R (c_tok + c_att c + c_prop) / T0
(x `_MARGIN` for the verification's own overhead): P of the first is the request's running rate,
and each later position multiplies in the proposer's running rate of accepting that position
given the ones before (shared by all requests: a draft model's later guesses are worse than its
first, prompt lookup's are not; a mean over the rounds that tried the position until it has had
~20, so a position that never pays stops being drafted after two or three tries: a slow average
from the starting 0.6 kept e7's head drafting a second token, right about a third of the times its
first was, in 29% of the bench's open-prompt steps, 1.15x against 1.22x). A request drafts no
further than that; if even its first draft does not pay, it waits, then probes again (with one
position more than pays, so each position's rate stays measured). New requests start from the
rate of the requests before them (and if that does not pay, wait 32 steps before their first
probe: a draft model's first probe also catches it up on the prompt). On the prior coefficients
the bar is ~0.3 for one stream at a short context and ~0.75 at 8 rows.

Prompt lookup first (`--speculative ngram+draft:PATH`): before the draft model is asked, the
n-gram proposer looks for the request's last `lookup_min` or more tokens earlier in its sequence;
where it finds them, its continuation is the step's draft (up to the positions whose lookup
acceptance rates, kept apart from the model's, still clear the bar at no proposer cost; when not
even the first does, every 32nd chance drafts one token so the rate stays measured) and the
model is not run for that request. Greedy answers of a small model repeat themselves: on the
bench's open prompts a match of 2 or more tokens is found at 17% of steps and 2.5 of its 4 tokens
are accepted, where the draft model's one guess is right about half the time.

Suffix decoding (`--speculative suffix`, `ngram+suffix`): drafts from earlier answers in the
request's cache scope and from its own tokens, each draft token priced by the index's own
probability (suffix.py), cut at the same break-even bar; no model runs, so the per-request pauses
above do not apply (the index's calibration and probes take their place).

Not eligible (they decode one token a step as before): requests that opted out
(`SamplingParams.speculative=False`), thinking requests (a reasoning budget), and
seeded sampled requests (their random stream, and therefore their tokens, must not depend on
whether the batch let them speculate).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from kvserve.engine.request import Request
from kvserve.engine.spec_decode.config import SpeculativeConfig
from kvserve.engine.spec_decode.draft import DraftProposer
from kvserve.engine.spec_decode.eagle import EAGLE_FILE, EagleProposer
from kvserve.engine.spec_decode.proposer import NgramProposer, Proposer
from kvserve.engine.spec_decode.suffix import SuffixDrafter

_EMA = 0.1            # weight of the newest round in a request's running acceptance rate once settled,
_PRIOR = 2            # and before: a mean over its rounds so far and _PRIOR rounds at the starting rate
_EMA_POS = 0.05       # ... and of the newest round in the proposer's rates by draft position, again after a
                      # mean over their first rounds (with _PRIOR at the starting rate)
_OFF_RATE = 0.25      # below this acceptance rate a request stops drafting for a while
_MIN_ROUNDS = 3       # ... judged only after this many drafting steps
_COOLDOWN0, _COOLDOWN_MAX = 8, 256
_COOLDOWN_COLD = 32   # the first wait of a request whose predecessors' first drafts did not pay
_MARGIN = 1.1         # the cost model's break-even acceptance rate, raised for verification overhead
_SETTLED = 16         # drafting rounds in a row after which a request's next pause is short again


@dataclass
class _ReqState:
    k: int
    rate: float = 0.6            # running rate of accepted first drafts
    rounds: int = 0
    pause: int = 0               # steps left without drafting
    cooldown: int = _COOLDOWN0   # the next pause's length
    behind: bool = False         # prompt lookup drafted since the model last did (its next round catches up)


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
        self._prop_samples: deque[float] = deque(maxlen=16)   # the proposer's seconds per draft token
        self.proposer_s_per_token = 0.0     # ... their median
        # pos_rate[0]: accepted first drafts over all requests (a new request's starting rate);
        # pos_rate[i]: P(draft i + 1 accepted | drafts 1..i were)
        self.pos_rate = [0.6] * config.num_speculative_tokens
        self._pos_rounds = [0] * config.num_speculative_tokens    # rounds that tried each position
        # prompt lookup before the model (ngram+draft): its own rates by position, and who it drafted for
        self.lookup = NgramProposer(config.ngram_max, config.lookup_min) if config.lookup_first else None
        self.lookup_rate = [0.8] * config.num_speculative_tokens
        self._lookup_rounds = [0] * config.num_speculative_tokens
        self._lookup_wait = _COOLDOWN_COLD     # chances left before a probe once its first position stops paying
        self.num_lookup_drafts = 0
        self._looked: set[str] = set()
        self.suffix = None if config.method != "suffix" else SuffixDrafter(
            config.num_speculative_tokens, config.suffix_budget, config.suffix_depth, config.suffix_threshold,
            NgramProposer(config.ngram_max, config.lookup_min) if config.suffix_lookup else None)

    @staticmethod
    def eligible(req: Request) -> bool:
        p = req.params
        return (p.speculative and (req.grammar_future is None or req.grammar is not None)
                and req.reasoning is None
                and (p.greedy or req.generator is None))

    def step_on(self, num_decodes: int) -> bool:
        cap = self.config.max_batch_rows
        return cap <= 0 or num_decodes < cap

    def break_even(self, contexts: list[int], cost=None, proposer_s: float | None = None) -> list[float]:
        """For a step of decodes at these context lengths: the probability of being accepted a draft
        token of each needs to pay (0 with no cost model, or the step switch off). proposer_s: the
        proposer's seconds per draft token (default: the model proposer's running median)."""
        if cost is None or self.config.max_batch_rows <= 0:
            return [0.0] * len(contexts)
        _, c_tok, _, c_att = cost.coef_floats
        t0 = cost.decode_step_seconds(contexts)
        if t0 <= 0:
            return [0.0] * len(contexts)
        R = len(contexts)
        prop = self.proposer_s_per_token if proposer_s is None else proposer_s
        return [_MARGIN * R * (c_tok + c_att * (c + 1) + prop) / t0 for c in contexts]

    @staticmethod
    def _room(r: Request) -> int:
        return (r.max_tokens if r.max_tokens is not None else 1 << 30) - len(r.output_token_ids) - 1

    def _look(self, r: Request, bar: float) -> list[int]:
        """Prompt lookup's draft for r: as many positions as still pay at its own rates (none found: []).
        Its rates are shared and only move when it drafts, so once even its first position does not pay,
        every `_COOLDOWN_COLD`-th chance still drafts one token: a workload that returns to repeating
        itself gets lookup back."""
        k, p, most = 0, 1.0, min(self.config.num_speculative_tokens, self._room(r))
        while k < most and p * self.lookup_rate[k] >= bar:
            p *= self.lookup_rate[k]
            k += 1
        if k == 0 and most > 0:
            self._lookup_wait -= 1
            if self._lookup_wait > 0:
                return []
            self._lookup_wait, k = _COOLDOWN_COLD, 1
        return self.lookup.lookup(r.prompt_token_ids + r.output_token_ids, k) if k else []

    def propose(self, reqs: list[Request], cost=None) -> list[list[int]]:
        """Draft tokens for each running decode (empty for those that do not speculate now).
        `cost`: the scheduler's StepCostModel (None: no cost check)."""
        if self.suffix is not None:
            return self._grammar_cut(reqs, self._propose_suffix(reqs, cost))
        drafts: list[list[int]] = [[] for _ in reqs]
        ready = []                      # (index, state or None for a new request) of those that may draft
        looking = []                    # indices prompt lookup tries first (paused or not: it costs nothing)
        self._looked = set()
        for i, r in enumerate(reqs):
            if not self.eligible(r):
                continue
            looking.append(i)
            st = self.state.get(r.request_id)
            if st is not None and st.pause > 0:
                st.pause -= 1
                continue
            ready.append((i, st))
        if not (ready or self.lookup and looking):   # everyone paused: no cost model to consult
            return drafts
        contexts = [r.num_tokens for r in reqs]
        if self.lookup is not None and looking:
            lbars = self.break_even(contexts, cost, proposer_s=0.0)
            for i in looking:
                drafts[i] = self._look(reqs[i], lbars[i])
                if drafts[i]:
                    self._looked.add(reqs[i].request_id)
                    st = self.state.get(reqs[i].request_id)
                    if st is not None:
                        st.behind = True
            ready = [(i, st) for i, st in ready if not drafts[i]]
        bars = self.break_even(contexts, cost) if ready else []
        batch, idx, steady = [], [], True
        for i, st in ready:
            r, bar = reqs[i], bars[i]
            if st is None:
                st = self.state[r.request_id] = _ReqState(self.config.num_speculative_tokens, self.pos_rate[0])
                if st.rate < bar:       # the requests before it did not pay here: a longer first wait
                    st.cooldown = _COOLDOWN_COLD
            if st.rate < bar:          # does not pay in this step: wait, then try again from the bar
                st.pause, st.cooldown = st.cooldown, min(_COOLDOWN_MAX, st.cooldown * 2)
                st.rate, st.rounds = max(0.6, bar), 0
                continue
            room = self._room(r)
            k, p = 1, st.rate           # draft positions while P(all accepted) still clears the bar
            while k < min(st.k, room) and p * self.pos_rate[k] >= bar:
                p *= self.pos_rate[k]
                k += 1
            if st.rounds == 0:          # a first round (new, or after a pause) also tries one more,
                k += 1                  # so the rate of a position that stopped paying is re-measured
            k = min(k, st.k, room)
            if k > 0:
                batch.append((r, k))
                idx.append(i)
                steady = steady and st.rounds > 0 and not st.behind
                st.behind = False
        if batch:
            t = time.perf_counter()
            proposed = self.proposer.propose(batch)
            n = sum(len(d) for d in proposed)
            if n and steady:    # a first round also catches the draft up on the positions it skipped: not priced
                self._prop_samples.append((time.perf_counter() - t) / n)
                self.proposer_s_per_token = statistics.median(self._prop_samples)
            for i, d in zip(idx, proposed):
                drafts[i] = d
        return self._grammar_cut(reqs, drafts)

    @staticmethod
    def _grammar_cut(reqs: list[Request], drafts: list[list[int]]) -> list[list[int]]:
        for i, d in enumerate(drafts):
            g = reqs[i].grammar
            if g is not None and d:
                drafts[i] = d[:g.validate_tokens(d)]     # drafts the grammar allows
        return drafts

    def _propose_suffix(self, reqs: list[Request], cost) -> list[list[int]]:
        """Suffix decoding's drafts: each eligible request's, cut at its break-even bar (suffix.py)."""
        drafts: list[list[int]] = [[] for _ in reqs]
        bars = self.break_even([r.num_tokens for r in reqs], cost, proposer_s=self.suffix.seconds_per_call)
        for i, r in enumerate(reqs):
            k = min(self.config.num_speculative_tokens, self._room(r))
            if k > 0 and self.eligible(r):
                drafts[i] = self.suffix.draft(r, k, bars[i])
        return drafts

    def draft_source(self, request_id: str) -> str:
        """Where the request's latest proposed draft came from (the inspector): "prompt", "request"
        (its own output), "other" (another request's answer), "model" (a draft model or head), "lookup"."""
        if self.suffix is not None:
            return self.suffix.sources.get(request_id, "")
        if request_id in self._looked or self.config.method == "ngram":
            return "prompt"
        return "model"

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """A verification round's result: adapt the request's k and count it."""
        if num_drafted <= 0:
            return
        K = self.config.num_speculative_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.acceptance_length_counts[min(num_accepted, K)] += 1
        if self.suffix is not None:
            self.suffix.observe(request_id, num_drafted, num_accepted)
            self.num_lookup_drafts = self.suffix.num_lookup_drafts
            return
        looked = request_id in self._looked
        rates, tried = (self.lookup_rate, self._lookup_rounds) if looked else (self.pos_rate, self._pos_rounds)
        for i in range(min(num_accepted + 1, num_drafted)):     # positions tried: 1..accepted + 1
            tried[i] += 1
            rates[i] += max(_EMA_POS, 1.0 / (tried[i] + _PRIOR)) * ((i < num_accepted) - rates[i])
        if looked:            # the model's own rate and pauses are not the lookup's
            self.num_lookup_drafts += 1
            return
        st = self.state.get(request_id)
        if st is None:
            return
        st.rounds += 1
        if st.rounds == _SETTLED:
            st.cooldown = _COOLDOWN0
        st.rate += max(_EMA, 1.0 / (st.rounds + _PRIOR)) * ((num_accepted > 0) - st.rate)
        st.k = min(K, st.k + 2) if num_accepted == num_drafted else max(1, num_accepted + 1)
        if st.rounds >= _MIN_ROUNDS and st.rate < _OFF_RATE:
            st.pause, st.cooldown = st.cooldown, min(_COOLDOWN_MAX, st.cooldown * 2)
            st.rate, st.rounds, st.k = 0.6, 0, K

    def forget(self, request_id: str, req: Request | None = None) -> None:
        """A request ended (req: it, so suffix decoding keeps what it said)."""
        self.state.pop(request_id, None)
        if self.suffix is not None:
            self.suffix.finish(req, request_id)
        drop = getattr(self.proposer, "forget", None)
        if drop is not None:
            drop(request_id)

    def stats(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_lookup_drafts": self.num_lookup_drafts,
                "spec_decode_acceptance_length_counts": list(self.acceptance_length_counts)}


def make_spec_decoder(config: SpeculativeConfig, model, tokenizer) -> SpecDecoder:
    """The decoder for an engine's target model (startup: errors here are one line, never mid-request)."""
    if config.method == "draft":   # an EAGLE head when the directory holds its fc (spec_decode/eagle.py)
        cls = EagleProposer if (Path(config.draft_path) / EAGLE_FILE).is_file() else DraftProposer
        return SpecDecoder(config, cls.load(config, model, tokenizer))
    return SpecDecoder(config)
