"""The core's side of structured output: compiled grammar templates, a matcher per request, and
the step's token bitmask computed while the forward pass runs.

    EngineCore.add_request   -> GrammarBackend.submit(grammar): a Future of the compiled template
                                (compiled on the backend's compile thread, once per grammar text;
                                the request waits in the queue meanwhile, nobody else does)
    Scheduler (admission)    -> the request's own matcher: a deep copy of the template
    Scheduler.schedule       -> ScheduledRequest.grammar_bitmask_slot for a row that samples
    ModelRunner.execute      -> start_bitmask() before the forward, bitmask() after the logits:
                                llguidance drops the GIL, so the masks are built on the mask
                                thread while the C kernels run the model (a lone row's mask
                                is built at once, before the forward: cheaper than a hand-off)
    Sampler                  -> apply_bitmask(): the batch's constrained rows in one masked_fill
    Scheduler.update_from_output -> matcher.consume_token for each accepted token; a stopped
                                matcher (grammar complete) ends the request with "stop"

The scheduler is the only writer of a matcher (consume); the runner's mask thread only reads it
(computing a mask does not move it), and only between schedule and update.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvserve.structured.grammar import GrammarCompiler, new_matcher

INLINE_MAX_ROWS = 1     # a step with this many grammar rows or fewer builds its masks before the forward


class GrammarBackend:
    def __init__(self, compiler: GrammarCompiler, cache_size: int = 256):
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self.words = (self.vocab_size + 31) // 32
        self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-grammar-compile")
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-grammar-mask")
        self._templates: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size
        self.num_compiled = 0

    def warm_up(self) -> None:
        """Build the llguidance tokenizer on the compile thread now (~0.2 s for a 49k vocabulary)."""
        self._compile_pool.submit(self.compiler.lltokenizer)

    def submit(self, grammar: str) -> Future:
        """A Future of the compiled template for `grammar` (cached per text, LRU)."""
        with self._lock:
            fut = self._templates.get(grammar)
            if fut is not None:
                self._templates.move_to_end(grammar)
                return fut
            ready = self.compiler.template(grammar)    # compiled by this process's client already
            if ready is not None:
                fut = Future()
                fut.set_result(ready)
            else:
                fut = self._compile_pool.submit(self._compile, grammar)
            self._templates[grammar] = fut
            while len(self._templates) > self.cache_size:
                self._templates.popitem(last=False)
            return fut

    def _compile(self, grammar: str):
        m = new_matcher(self.compiler.lltokenizer(), grammar)
        if m.is_error():
            with self._lock:
                self._templates.pop(grammar, None)
            raise ValueError(f"the grammar does not compile: {m.get_error()}")
        self._fill([m])     # the first mask builds lexer states every copy then starts with
        self.num_compiled += 1
        return m

    @staticmethod
    def new_matcher(template_future: Future):
        """The request's own matcher (raises the compile error, if any)."""
        return template_future.result().deep_copy()

    # ---- the step's bitmask ---------------------------------------------------------------------
    def start_bitmask(self, matchers: list) -> Future:
        """Compute the next-token bitmask of each matcher (row i for matchers[i]) on the mask thread.
        A single row's mask (median ~13 us) is computed here at once instead: handing it to a thread
        costs a wake-up, which on a busy machine is longer than the mask (measured, BENCHMARKS.md)."""
        if len(matchers) <= INLINE_MAX_ROWS:
            done: Future = Future()
            done.set_result(self._fill(matchers))
            return done
        return self._mask_pool.submit(self._fill, matchers)

    def bitmask(self, job: Future, matchers: list) -> torch.Tensor:
        """The result of start_bitmask(matchers). If the mask thread has not even started on it (a
        busy machine did not schedule it during the forward), it is computed here instead of
        waiting for that thread to wake up."""
        return self._fill(matchers) if job.cancel() else job.result()

    def _fill(self, matchers: list) -> torch.Tensor:
        mask = torch.empty((len(matchers), self.words), dtype=torch.int32)
        nbytes = self.words * 4
        for i, m in enumerate(matchers):
            row = mask[i]
            m.unsafe_compute_mask_ptr(row.data_ptr(), nbytes)
        return mask

    def draft_bitmask(self, matcher, drafts: list[int]) -> torch.Tensor:
        """Speculative decoding: the masks after each prefix of `drafts` (row j: after drafts[:j],
        k + 1 rows). The matcher is walked through the drafts (the scheduler checked them with
        validate_tokens) and rolled back, so it is where it was when this returns."""
        mask = torch.empty((len(drafts) + 1, self.words), dtype=torch.int32)
        nbytes = self.words * 4
        consumed = 0
        try:
            for j in range(len(drafts) + 1):
                matcher.unsafe_compute_mask_ptr(mask[j].data_ptr(), nbytes)
                if j < len(drafts):
                    if not matcher.consume_token(drafts[j]):
                        mask[j + 1:].zero_()          # (cannot happen after validate_tokens)
                        break
                    consumed += 1
        finally:
            if consumed:
                matcher.rollback(consumed)
        return mask

    def shutdown(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._mask_pool.shutdown(wait=False, cancel_futures=True)


# bit j of a byte, LSB first: a little-endian int32 word w holds tokens 32w .. 32w+31 in its 4 bytes
_UNPACK = torch.tensor([[(b >> j) & 1 for j in range(8)] for b in range(256)], dtype=torch.bool)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """-inf at every token a row's grammar forbids (bit j of word w set: token 32*w + j allowed).
    One table lookup unpacks the bits (byte -> 8 bools), one masked fill applies them."""
    V = logits.shape[1]
    packed = bitmask.contiguous().view(torch.uint8).view(-1).long()
    allowed = _UNPACK.index_select(0, packed).view(len(rows), -1)
    if allowed.shape[1] < V:   # logits wider than the tokenizer: the extra ids are never valid
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]), value=False)
    forbidden = ~allowed[:, :V].to(logits.device)
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(forbidden, float("-inf"))
    else:
        idx = torch.tensor(rows, device=logits.device)
        logits[idx] = logits[idx].masked_fill_(forbidden, float("-inf"))
