"""`--speculative ngram|suffix[:BUDGET]|ngram+suffix[:BUDGET]|draft:PATH|ngram+draft:PATH
--num-speculative-tokens K`, checked once at
startup: a bad value is a one-line `InvalidRequest`, never an error in the middle of a request."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.errors import InvalidRequest

MAX_SPECULATIVE_TOKENS = 16
FORMS = "'ngram', 'suffix[:BUDGET]', 'ngram+suffix[:BUDGET]', 'draft:PATH' or 'ngram+draft:PATH'"
SPECULATIVE_HELP = ("Speculative decoding: ngram (prompt lookup), suffix[:BUDGET] (drafts from earlier answers in the "
                    "same cache scope, a trie of at most BUDGET tokens, default 10000), ngram+suffix[:BUDGET] (the "
                    "more probable of the two), draft:PATH (a draft model) or ngram+draft:PATH (prompt lookup first, "
                    "the draft model where it finds nothing).")
NUM_SPEC_HELP = "Most draft tokens per step (1-16, default 4; adapted per request)."


@dataclass
class SpeculativeConfig:
    method: str = "ngram"                 # "ngram" (prompt lookup), "suffix" (earlier answers) or "draft" (a model)
    num_speculative_tokens: int = 4       # most draft tokens per step (the adaptive k's ceiling)
    draft_path: str | None = None         # method "draft": the draft model's file or directory
    ngram_max: int = 4                    # longest suffix the n-gram proposer matches ...
    ngram_min: int = 1                    # ... and the shortest
    lookup_first: bool = False            # method "draft": prompt lookup first, the model where it finds
    lookup_min: int = 2                   # nothing ('ngram+draft:PATH'), matching this many tokens or more
    # The step's switch: no drafts once the step's decoding rows reach this many (a batch that big
    # is compute-bound on a CPU, so verifying drafts costs as much as it saves). 0: never switch off.
    max_batch_rows: int = 8
    # method "draft": the GGUF blocks the draft's weights are packed into at load (model/linear.py);
    # q4_1 reads 0.63 of q8_0's bytes a draft step
    draft_weight_format: str = "q8_0"
    # method "suffix" (spec_decode/suffix.py): tokens kept in the tries over all cache scopes (the oldest
    # requests' go first), the longest substring indexed, the least share of its continuations a draft
    # token must have, and prompt lookup beside it ('ngram+suffix')
    suffix_budget: int = 10_000
    suffix_depth: int = 24
    suffix_threshold: float = 0.3
    suffix_lookup: bool = False

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise InvalidRequest(f"num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, "
                                 f"got {k!r}", param="num_speculative_tokens")
        if self.method not in ("ngram", "draft", "suffix"):
            raise InvalidRequest(f"unknown speculative proposer {self.method!r}: use {FORMS}",
                                 param="speculative")
        if self.method == "draft" and not self.draft_path:
            raise InvalidRequest("speculative 'draft:PATH' needs the draft model's path", param="speculative")
        if not 1 <= self.ngram_min <= self.ngram_max or not 1 <= self.lookup_min <= self.ngram_max:
            raise InvalidRequest("ngram_min and lookup_min must be >= 1 and <= ngram_max", param="speculative")
        from kvserve.model.linear import PACKED_FORMATS

        if self.draft_weight_format not in PACKED_FORMATS:
            raise InvalidRequest(f"draft_weight_format must be one of {PACKED_FORMATS}, got {self.draft_weight_format!r}",
                                 param="speculative")
        if self.method == "suffix" and not (isinstance(self.suffix_budget, int) and self.suffix_budget >= 64
                                            and 2 <= self.suffix_depth <= 64 and 0 < self.suffix_threshold <= 1):
            raise InvalidRequest("suffix needs a budget of at least 64 tokens ('suffix:50000'), a depth from 2 to 64 "
                                 "and a threshold in (0, 1]", param="speculative")
        if self.suffix_lookup and self.method != "suffix":
            raise InvalidRequest("suffix_lookup goes with 'ngram+suffix'", param="speculative")
        if self.lookup_first and self.method != "draft":
            raise InvalidRequest("lookup_first goes with a draft model ('ngram+draft:PATH')", param="speculative")

    @classmethod
    def parse(cls, spec: str | dict | SpeculativeConfig | None, num_speculative_tokens: int | None = None
              ) -> SpeculativeConfig | None:
        """'ngram', 'suffix[:BUDGET]', 'ngram+suffix[:BUDGET]', 'draft:PATH', 'ngram+draft:PATH', a dict of fields, a SpeculativeConfig, or None/''/'off' (none)."""
        if num_speculative_tokens is not None:
            cls(num_speculative_tokens=num_speculative_tokens)      # the range check, even with no proposer
        if spec is None or isinstance(spec, SpeculativeConfig):
            if spec is not None and num_speculative_tokens is not None:
                spec.num_speculative_tokens = num_speculative_tokens
                spec.__post_init__()
            return spec
        extra = {} if num_speculative_tokens is None else {"num_speculative_tokens": num_speculative_tokens}
        if isinstance(spec, dict):
            try:
                return cls(**{**spec, **extra})
            except TypeError as e:
                raise InvalidRequest(f"bad speculative options: {e}", param="speculative") from None
        if not isinstance(spec, str):
            raise InvalidRequest(f"speculative must be {FORMS}, got {spec!r}", param="speculative")
        s = spec.strip()
        if s in ("", "off", "none"):
            return None
        if s == "ngram":
            return cls("ngram", **extra)
        for form, lookup in (("ngram+suffix", True), ("suffix", False)):
            if s == form or s.startswith(form + ":"):
                budget = s[len(form) + 1:]
                try:
                    opts = {"suffix_budget": int(budget)} if budget else {}
                except ValueError:
                    raise InvalidRequest(f"{form}:BUDGET takes a number of tokens, got {budget!r}",
                                         param="speculative") from None
                return cls("suffix", suffix_lookup=lookup, **opts, **extra)
        if s.startswith("draft:"):
            return cls("draft", draft_path=s[len("draft:"):], **extra)
        if s.startswith("ngram+draft:"):
            return cls("draft", draft_path=s[len("ngram+draft:"):], lookup_first=True, **extra)
        raise InvalidRequest(f"unknown speculative proposer {spec!r}: use {FORMS}", param="speculative")
