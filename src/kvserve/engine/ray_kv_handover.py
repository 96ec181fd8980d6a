"""How a RayClient (engine/ray_client.py) has a request's prefix KV blocks land on the replica that
serves it, before the request arrives there (the payloads are engine/disagg.py's):

* disaggregated (`_prefill`): a prefill replica computes the prompt (max_tokens 1) and exports
  its blocks;
* a fetched prefix (`_fetch`): the router (engine/replica_router.py) chose replica B, but a
  replica A sharing no disk store with B holds a longer prefix of the prompt (B was less loaded,
  say): A exports the prefix it holds, RAM then disk.

Either way the payload is an object-store reference handed from one actor to the other (the bytes
go replica to replica, never through the gateway), and the request follows it in the same call
(`submit_with_kv`). A failure (the donor died, timed out, held nothing) sends the request alone:
B computes the prompt; a payload B's checks refuse is the same miss.

A mixin of RayClient: it reads the client's routing state (`router`, `replicas`, `_where`, ...).
"""

from __future__ import annotations

import logging
import time

import msgspec

from kvserve.engine.messages import EngineCoreRequest, encode
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve.engine")


class KVHandover:
    num_kv_fetches = 0            # requests sent with a prefix fetched from another replica

    def _prefill(self, first: EngineCoreRequest, decode_index: int, data: list[bytes], ids: list[str]) -> bool:
        """Disaggregated: run the prompt on a prefill replica; when its KV payload is ready, hand
        it to the decode replica."""
        decoders = frozenset(r.index for r in self.replicas if r.role != "prefill")
        try:
            p = self.router.route(first.prompt_token_ids, first.cache_salt, first.cache_salt_from, exclude=decoders)
        except LookupError:
            return False           # no prefill replica left: the decode replica computes the prompt
        pre = msgspec.structs.replace(first, request_id=first.request_id + "@prefill", wait_for=None,
                                      sampling_params=SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                                      want_prompt_logprobs=False, structured_output=None, reasoning_end_ids=None)
        t0 = time.monotonic()
        status, ref = self.replicas[p].actor.prefill.options(concurrency_group="prefill", num_returns=2).remote(
            encode(pre))
        status.future().add_done_callback(lambda fut: self._call_soon(self._prefilled, p, decode_index, ref, fut,
                                                                   data, ids, t0))
        return True

    def _prefilled(self, p: int, d: int, ref, fut, data: list[bytes], ids: list[str], t0: float) -> None:
        """On the event loop, once the prefill replica answered (or died)."""
        self.router.done(p)
        if self._hand_over(d, ref, fut, data, ids, "prefill") and fut.exception() is None:
            now = time.monotonic()
            pool = self.pools["prefill"]
            pool.requests += 1
            pool.ttft_seconds_sum += now - t0
            self._decode_start[ids[0]] = now

    def _fetch(self, first: EngineCoreRequest, index: int, donor: int, data: list[bytes], ids: list[str]) -> None:
        """Ask `donor` for the prompt's prefix it holds; the request goes to `index` with it."""
        bs = self.block_size
        stub = msgspec.structs.replace(first, sampling_params=SamplingParams(max_tokens=1), structured_output=None,
                                       reasoning_end_ids=None, draft_token_ids=None)
        status, ref = self.replicas[donor].actor.export_prefix.options(concurrency_group="export",
                                                                       num_returns=2).remote(
            encode(stub), (len(first.prompt_token_ids) - 1) // bs)
        status.future().add_done_callback(
            lambda fut: self._call_soon(self._hand_over, index, ref, fut, data, ids, f"replica {donor}"))

    def _hand_over(self, d: int, ref, fut, data: list[bytes], ids: list[str], source: str) -> bool:
        """On the event loop, once a payload for these requests is ready (or failed): send them to
        replica d with it, or alone. False when they moved (d died) or the client gave up."""
        core_id = ids[0]
        if self._where.get(core_id) != d or not self.replicas[d].alive:
            return False            # its replica died meanwhile and it moved on
        if core_id not in self.outputs.parent_of:   # the client gave up while the blocks were coming
            for cid in ids:
                if self._where.pop(cid, None) is not None:
                    self._reqs.pop(cid, None)
                    self.router.done(d)
            return False
        if fut.exception() is None:
            if source != "prefill":
                self.num_kv_fetches += 1
            self.replicas[d].actor.submit_with_kv.options(concurrency_group="kv").remote(ref, data)
        else:
            logger.warning("KV blocks of %s from %s failed (%s): replica %d computes them", core_id, source,
                           fut.exception(), d)
            self.replicas[d].actor.submit.remote(data)
        return True
