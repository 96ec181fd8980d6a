"""Beam search on top of the engine, one token at a time (the way vLLM's `LLM.beam_search` works).

Each step turns every live beam into an ordinary 1-token request on `prompt + beam` asking for
the top 2*W raw logprobs; prefix caching makes re-reading the shared prefix nearly free. The
candidates of all beams of a prompt are ranked by score, the best W survive, and a candidate
that ends in EOS is set aside as finished. Nothing in the engine knows about beams.

Score (as in Hugging Face): cumulative raw logprob / (number of output tokens ** length_penalty),
so length_penalty > 1 favours longer sequences and 0 ranks by plain cumulative logprob.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.errors import InvalidRequest
from kvserve.outputs import Logprob
from kvserve.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise InvalidRequest(f"beam width must be an integer >= 1, got {self.beam_width!r}.", param="best_of")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.",
                                 param="max_tokens")

    @classmethod
    def from_sampling_params(cls, params: SamplingParams, max_tokens: int) -> BeamSearchParams:
        """Width best_of (or n); `max_tokens` is params.max_tokens or, if None, the room left."""
        return cls(beam_width=params.num_sequences, max_tokens=params.max_tokens or max_tokens,
                   ignore_eos=params.ignore_eos, length_penalty=params.length_penalty)


@dataclass
class BeamSearchSequence:
    token_ids: list[int]                 # output tokens only
    cumulative_logprob: float
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None     # "stop" (EOS) or "length"

    def score(self, length_penalty: float) -> float:
        return self.cumulative_logprob / max(1, len(self.token_ids)) ** length_penalty


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]  # best first, beam_width of them


def beam_search(llm, prompts: list, params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Run beam search for each prompt (a string, token ids or {"prompt_token_ids": [...]}) with a
    `kvserve.engine.llm.LLM`; all prompts' beams share each engine step."""
    tok = llm.get_tokenizer()
    eos = set(tok.eos_token_ids)
    width = params.beam_width
    prompt_ids = [_prompt_ids(tok, p) for p in prompts]
    live: list[list[BeamSearchSequence]] = [[BeamSearchSequence([], 0.0)] for _ in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=min(2 * width, 20),
                                 skip_special_tokens=False)

    for _ in range(params.max_tokens):
        jobs = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not jobs:
            break
        outs = llm.generate([{"prompt_token_ids": prompt_ids[i] + beam.token_ids} for i, beam in jobs],
                            step_params, use_tqdm=False)
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), out in zip(jobs, outs):
            position = out.outputs[0].logprobs[0]
            for token_id, lp in position.items():
                candidates[i].append(BeamSearchSequence(
                    beam.token_ids + [token_id], beam.cumulative_logprob + lp.logprob,
                    beam.logprobs + [position]))
        for i, cands in enumerate(candidates):
            cands.sort(key=lambda s: s.score(params.length_penalty), reverse=True)
            live[i] = []
            for seq in cands[:width]:
                if seq.token_ids[-1] in eos and not params.ignore_eos:
                    seq.finish_reason = "stop"
                    done[i].append(seq)
                else:
                    live[i].append(seq)

    results = []
    for i, ids in enumerate(prompt_ids):
        for seq in live[i]:
            seq.finish_reason = "length"
        best = sorted(done[i] + live[i], key=lambda s: s.score(params.length_penalty), reverse=True)[:width]
        for seq in best:
            seq.text = tok.decode(seq.token_ids, skip_special_tokens=True)
        results.append(BeamSearchOutput(ids, best))
    return results


def _prompt_ids(tok, prompt) -> list[int]:
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if isinstance(prompt, str):
        return tok.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise InvalidRequest("a prompt is a string, a list of token ids or {'prompt_token_ids': [...]}",
                         param="prompt")
