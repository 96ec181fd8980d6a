"""Per-request decoding controls, with vLLM's field names and defaults.

Every field is checked in `__post_init__`; a bad value raises `kvserve.errors.InvalidRequest`
whose `param` names the field, so the server can return an OpenAI-shaped 400 that points at it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvserve.errors import InvalidRequest

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class RepetitionGuard:
    """End a generation stuck in a loop (finish_reason "repetition"): the output ends with a block
    of p <= `window` tokens repeated `repeats` times back to back.

    window=3, repeats=4 stops on `... a b c a b c a b c a b c` and on `... x x x x`; every period
    from 1 to `window` is tried, so pick `repeats` high enough for legitimately repetitive text
    (tables, lists of numbers). Off unless a request sets it.
    """

    window: int = 16
    repeats: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            raise InvalidRequest(f"repetition_guard.window must be an integer >= 1, got {self.window!r}.",
                                 param="repetition_guard")
        if not isinstance(self.repeats, int) or isinstance(self.repeats, bool) or self.repeats < 2:
            raise InvalidRequest(f"repetition_guard.repeats must be an integer >= 2, got {self.repeats!r}.",
                                 param="repetition_guard")


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's field names); exactly one of the fields is set.

    json: a JSON schema (dict or its text); json_object: any JSON object; regex: a regular
    expression the whole output matches; choice: one of these strings exactly; grammar: a Lark or
    GBNF/EBNF grammar (llguidance's dialect). The engine compiles it once per distinct spec
    (kvserve.structured) and masks every step's logits to the tokens that keep the output a valid
    prefix; the request ends ("stop") as soon as the grammar is complete."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise InvalidRequest("structured_outputs takes exactly one of json, regex, choice, grammar or "
                                 f"json_object, got {kinds or 'none'}.", param="structured_outputs")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequest("structured_outputs.json must be a JSON schema (an object).",
                                 param="structured_outputs.json")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise InvalidRequest(f"structured_outputs.{name} must be a non-empty string.",
                                     param=f"structured_outputs.{name}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequest("structured_outputs.choice must be a list of non-empty strings.",
                                 param="structured_outputs.choice")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, k) not in (None, False))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _from_dict(cls: type, fields: dict, usage: str, param: str):
    """`cls(**fields)` for a field given as a JSON object; unknown keys (the TypeError) are the
    user's mistake, answered with `usage`."""
    try:
        return cls(**fields)
    except TypeError:
        raise InvalidRequest(usage, param=param) from None


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    Order in which the sampler applies them (see `kvserve.engine.sampler.Sampler`):
    logit_bias → min_tokens / ignore_eos masking → repetition_penalty → presence/frequency
    penalties → (greedy if temperature == 0) → temperature → top_k → top_p → min_p → sample.

    `logprobs` / `prompt_logprobs` report log-probabilities from the model's *raw* distribution,
    i.e. log_softmax of the logits before logit_bias, penalties, temperature and truncation
    (the same choice as vLLM). `logprobs=0` returns only the chosen token's logprob; `k > 0`
    adds the top-k alternatives.

    `max_tokens=None` means "until the context window is full". `stop` strings end the output
    exactly where they begin (the string itself is kept only with include_stop_str_in_output);
    `stop_token_ids` end it after that token. `n` completions are returned; `best_of` (>= n)
    are generated and the n with the highest cumulative logprob kept. With use_beam_search the
    beam width is best_of (or n); temperature, top_k, top_p and min_p are then ignored and beams
    are ranked by cumulative logprob / length**length_penalty.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    repetition_guard: RepetitionGuard | None = None
    structured_outputs: StructuredOutputsParams | None = None
    reasoning_budget: int | None = None   # the prompt opened <think>; force </think> after this many tokens
    speculative: bool = True              # False: never draft tokens for this request (speculative decoding)
    # Normalised forms, filled in by __post_init__.
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_distribution()
        self._check_penalties()
        self._check_stopping()
        self._check_logprobs()
        if not isinstance(self.speculative, bool):
            raise InvalidRequest(f"speculative must be true or false, got {self.speculative!r}.", param="speculative")

    # ---- validation, one group per concern -------------------------------------------------
    def _check_counts(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise InvalidRequest(f"n must be an integer >= 1, got {self.n!r}.", param="n")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise InvalidRequest(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}.",
                                 param="best_of")
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequest(f"seed must be an integer or null, got {self.seed!r}.", param="seed")
        if not _is_num(self.length_penalty):
            raise InvalidRequest(f"length_penalty must be a finite number, got {self.length_penalty!r}.",
                                 param="length_penalty")

    def _check_distribution(self) -> None:
        if not _is_num(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be a number >= 0 (0 means greedy), got "
                                 f"{self.temperature!r}.", param="temperature")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequest(f"top_k must be an integer: -1 or 0 to disable, or >= 1, got "
                                 f"{self.top_k!r}.", param="top_k")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}.", param="top_p")
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p!r}.", param="min_p")

    def _check_penalties(self) -> None:
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequest(f"repetition_penalty must be a number > 0 (1 disables it), got "
                                 f"{self.repetition_penalty!r}.", param="repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2.0 <= v <= 2.0:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {v!r}.", param=name)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequest("logit_bias must be a map from token id to a bias in [-100, 100].",
                                     param="logit_bias")
            bias: dict[int, float] = {}
            for k, v in self.logit_bias.items():
                # JSON object keys arrive as strings ("50256"); accept those that are integers.
                tok = k
                if isinstance(k, str) and k.strip().lstrip("-").isdigit():
                    tok = int(k)
                if not _is_int(tok) or tok < 0:
                    raise InvalidRequest(f"logit_bias keys must be non-negative token ids, got {k!r}.",
                                         param="logit_bias")
                if not _is_num(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                    raise InvalidRequest(f"logit_bias values must be in [-100, 100], got {v!r} for token "
                                         f"{k!r}.", param="logit_bias")
                bias[tok] = float(v)
            self.logit_bias = bias or None

    def _check_stopping(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise InvalidRequest(f"max_tokens must be an integer >= 1 or null, got {self.max_tokens!r}.",
                                 param="max_tokens")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}.",
                                 param="min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                                 f"({self.max_tokens}).", param="min_tokens")
        stop = self.stop
        if stop is None:
            stops: list[str] = []
        elif isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, (list, tuple)):
            stops = list(stop)
        else:
            raise InvalidRequest("stop must be a string or a list of strings.", param="stop")
        for s in stops:
            if not isinstance(s, str) or s == "":
                raise InvalidRequest(f"stop strings must be non-empty strings, got {s!r}.", param="stop")
        self.stop_strings = stops
        if self.stop_token_ids is not None:
            ids = list(self.stop_token_ids) if isinstance(self.stop_token_ids, (list, tuple, set)) else None
            if ids is None or not all(_is_int(t) and t >= 0 for t in ids):
                raise InvalidRequest("stop_token_ids must be a list of non-negative token ids.",
                                     param="stop_token_ids")
            self.stop_token_ids = ids
        if self.repetition_guard is not None:
            g = self.repetition_guard
            if isinstance(g, (tuple, list)) and len(g) == 2:
                self.repetition_guard = RepetitionGuard(*g)
            elif isinstance(g, dict):
                self.repetition_guard = _from_dict(RepetitionGuard, g, "repetition_guard takes {'window': K, "
                                                   "'repeats': N}.", "repetition_guard")
            elif not isinstance(g, RepetitionGuard):
                raise InvalidRequest("repetition_guard must be {'window': K, 'repeats': N} or null.",
                                     param="repetition_guard")
        if self.reasoning_budget is not None and (not _is_int(self.reasoning_budget) or self.reasoning_budget < 1):
            raise InvalidRequest(f"reasoning_budget must be an integer >= 1 or null, got {self.reasoning_budget!r}.",
                                 param="reasoning_budget")
        if self.use_beam_search and (self.structured_outputs is not None or self.reasoning_budget is not None):
            raise InvalidRequest("beam search does not take structured_outputs or reasoning_budget.",
                                 param="use_beam_search")
        so = self.structured_outputs
        if isinstance(so, dict):
            self.structured_outputs = _from_dict(StructuredOutputsParams, so, "structured_outputs takes json, "
                                                 "regex, choice, grammar or json_object.", "structured_outputs")
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            raise InvalidRequest("structured_outputs must be a StructuredOutputsParams or a dict.",
                                 param="structured_outputs")

    def _check_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise InvalidRequest(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or null, got {v!r}.",
                                     param=name)

    # ---- derived ---------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        """Temperature 0: take the argmax (beam search also scores with the raw distribution)."""
        return self.temperature < _GREEDY_EPS

    @property
    def num_sequences(self) -> int:
        """How many sequences the engine generates for this request (best_of if set, else n)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop_strings), default=0)


# Temperatures below this are treated as greedy (dividing by ~0 overflows logits).
_GREEDY_EPS = 1e-5
