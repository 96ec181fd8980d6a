"""The Batch API's runner: every line of a batch through the same path as an interactive request
of its key, in the engine's spare capacity, resumable after a restart.

One `BatchRunner` per server (started and stopped with the app). Its loop takes the active
batches from the store (stores/batches.py) and moves each along:

    validating   the input file read, each line checked (gates/limits.py's body checks, one line
                 held at a time) and stored in the same pass, the batch in_progress, in one
                 transaction (or failed with the first error: a bad line, another endpoint's
                 line, the key's lines quota)
    in_progress  lines claimed one at a time while fewer than `room()` run (`concurrency` on an
                 idle server, one while interactive requests are admitted), round-robin between
                 the owners with lines waiting; each line takes one token of its key's rpm, then
                 runs as the route would (build_plan → Lease.acquire → run_to_end → renderer), at
                 `BATCH_PRIORITY` below every interactive request; an embeddings line goes to the
                 encoder, charged the same way. The result is written and the line marked done in
                 one UPDATE.
    finalizing   no line pending: the output and error files written (ids derived from the batch,
                 so writing them again after a crash finds them), then completed
    cancelling   the batch's running lines stopped (their leases abort the engine requests), the
                 files of what was done written, then cancelled
    expired      past expires_at: pending lines failed as `batch_expired`, files written

A 429 or 503 a line meets (the key's buckets, a full queue, the model loading) gives the line's
claim and slot back, and its owner's lines wait Retry-After (`not_before`). The claims of the
running lines are refreshed by a task of their own every HEARTBEAT_S and released on shutdown, so
a restarted server, or another replica on the same PostgreSQL, resumes with exactly the lines no
one answered and never claims a running one; a killed server's claims are free again after
`CLAIM_STALE_S`. Every PURGE_S the runner deletes expired files and finished batches past their
keep time, and every STATS_S it sets the stored-bytes gauges of /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from kvserve.errors import AuthenticationError, InvalidRequest, KVServeError
from kvserve.server.api.embeddings import EmbeddingRequest
from kvserve.server.api.files import MAX_LINE_BYTES, batch_lines
from kvserve.server.api.openai_wire import INTERNAL_ERROR, OpenAIRenderer
from kvserve.server.api.rerank import check_texts
from kvserve.server.gates.auth import LEGACY_DB_CLI_NAME
from kvserve.server.gates.encoder_usage import charged_encode
from kvserve.server.generation.lease import Lease
from kvserve.server.generation.plan import build_plan
from kvserve.server.generation.run import run_to_end
from kvserve.server.generation.state import Generation
from kvserve.server.generation.trace import TokenTexts
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, validate_body
from kvserve.server.records import RequestRecord
from kvserve.server.stores.keys import CLI_KEY_NAME, ApiKey

if TYPE_CHECKING:
    from kvserve.server.state import ServerState
    from kvserve.server.stores.batches import BatchStore
    from kvserve.server.stores.files import FileStore

logger = logging.getLogger("kvserve.server")
access_log = logging.getLogger("kvserve.access")

BATCH_PRIORITY = 10_000_000     # added to a line's engine priority: after every interactive tier
BUSY_CONCURRENCY = 1            # lines at once while interactive requests run
CLAIM_STALE_S = 60.0
HEARTBEAT_S = 15.0
POLL_S = 1.0
MAX_RETRY_WAIT_S = 30.0
PURGE_S = 300.0                 # expired files and finished batches purged this often
STATS_S = 5.0                   # the stored-bytes gauges refreshed this often


class _Backoff(Exception):
    """A line met a 429/503: its claim goes back and its owner waits `wait` seconds (no slot held)."""

    def __init__(self, wait: float):
        self.wait = wait


async def _never() -> dict[str, Any]:
    """A `receive` for a line: nobody hangs up."""
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


def line_result(custom_id: str, request_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """One line of an output or error file, in OpenAI's shape."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


class BatchRunner:
    def __init__(self, gw: ServerState, store: BatchStore, files: FileStore, concurrency: int):
        self.gw, self.store, self.files = gw, store, files
        self.concurrency = max(1, concurrency)
        self.name = f"runner-{uuid.uuid4().hex[:12]}"
        self.running: dict[tuple[str, int], asyncio.Task] = {}
        self.admitting = 0      # lines waiting for or holding an admission slot
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._keys: tuple[float, dict[str, ApiKey]] = (0.0, {})
        self._beat: asyncio.Task | None = None
        self.not_before: dict[str, float] = {}   # owner → when its lines may start again (after a 429)
        self._turn = 0                            # the round-robin's place among owners
        self.paid: set[tuple[str, int]] = set()   # lines that took their request token (one per line)

    # ---- life ----------------------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._loop(), name="kvserve-batch-runner")
        self._beat = loop.create_task(self._heartbeats(), name="kvserve-batch-heartbeat")

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        """Stop the loop and the running lines (their engine requests aborted), give back the claims."""
        tasks = [t for t in (self._task, self._beat, *self.running.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.store.release, self.name)

    async def _loop(self) -> None:
        purged = counted = 0.0
        while True:
            try:
                if time.monotonic() - purged > PURGE_S:
                    purged = time.monotonic()
                    await asyncio.to_thread(self._purge)
                if time.monotonic() - counted > STATS_S:
                    counted = time.monotonic()
                    await asyncio.to_thread(self._count_stored)
                rows = await asyncio.to_thread(self.store.active)
                for row in rows:
                    if row["status"] != "in_progress" or time.time() > row["expires_at"]:
                        await self._advance(row)
                await self._fill_fair([r for r in rows if r["status"] == "in_progress"
                                       and time.time() <= r["expires_at"]])
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("batch runner step failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), POLL_S)
            self._wake.clear()

    async def _heartbeats(self) -> None:
        """The claims of the running lines refreshed every HEARTBEAT_S, on a task of its own: a
        long runner pass (a big file validated, output written) never lets them go stale, so no
        other runner (this one included) claims a running line again."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            if self.running:
                try:
                    await asyncio.to_thread(self.store.heartbeat, self.name, list(self.running))
                except Exception:
                    logger.exception("batch runner heartbeat failed")

    def _count_stored(self) -> None:
        metrics = getattr(self.gw, "metrics", None)
        if metrics is None:
            return
        n, size = self.files.stored()
        metrics.files_stored.set(n)
        metrics.files_stored_bytes.set(size)
        metrics.batch_lines_stored.set(self.store.stored_lines())

    def _purge(self) -> None:
        files, batches = self.files.purge(), self.store.purge()
        if files or batches:
            logger.info("purged %d expired files and %d finished batches", files, batches)

    # ---- a batch's steps -------------------------------------------------------------------

    async def _advance(self, row: dict[str, Any]) -> None:
        status, batch_id = row["status"], row["id"]
        if status == "validating":
            await asyncio.to_thread(self._validate, row)
        elif status == "cancelling":
            await self._stop_lines(batch_id)
            await asyncio.to_thread(self._write_files, row, "cancelled", ("cancelling",))
        elif status == "finalizing":
            await asyncio.to_thread(self._write_files, row, "completed", ("finalizing",))
        elif time.time() > row["expires_at"]:
            await self._stop_lines(batch_id)
            expired = {"error": {"message": "This request was not run before the batch expired.",
                                 "type": "invalid_request_error", "param": None, "code": "batch_expired"}}
            await asyncio.to_thread(self.store.fail_pending, batch_id,
                                    lambda cid: line_result(cid, "", 400, expired))
            await asyncio.to_thread(self._write_files, row, "expired", ("in_progress",))

    def _validate(self, row: dict[str, Any]) -> None:
        """Each line checked as it is read (never all held) and stored in the same pass, in one
        transaction: a bad line, a line for another endpoint or the owner's lines quota rolls it
        back and fails the batch with that error."""
        depth = self.gw.settings.max_json_depth
        cap = max(MAX_LINE_BYTES, self.gw.settings.max_body_bytes)

        def checked(text: str):
            for i, custom_id, url, body in batch_lines(text, cap, depth):
                if url != row["endpoint"]:
                    err = InvalidRequest(f"Line {i}: the url {url!r} is not the batch's endpoint "
                                         f"{row['endpoint']!r}.", param="url", code="invalid_url")
                    err.line = i   # type: ignore[attr-defined]
                    raise err
                yield custom_id, json.dumps(body)

        try:
            started = self.store.start(row["id"], checked(self.files.content(row["owner"], row["input_file_id"])))
        except KVServeError as e:
            self.store.fail(row["id"], [{"code": e.code or "invalid_file", "message": e.message, "param": e.param,
                                         "line": getattr(e, "line", None)}])
            return
        if started:
            logger.info("batch %s: in progress", row["id"])

    async def _fill_fair(self, rows: list[dict[str, Any]]) -> None:
        """Start lines while there is room, one per owner in turn (round-robin over the owners with
        pending lines, their batches oldest first), skipping owners backing off after a 429; a
        batch with nothing pending or running is finalized."""
        owners: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            owners.setdefault(row["owner"], []).append(row)
        now = time.monotonic()
        ready = [o for o in sorted(owners) if self.not_before.get(o, 0.0) <= now]
        if ready:
            k = self._turn % len(ready)
            ready = ready[k:] + ready[:k]
        emptied: set[str] = set()
        while ready and len(self.running) < self.room():
            owner = ready.pop(0)
            started = False
            for row in owners[owner]:
                if row["id"] in emptied:
                    continue
                if await self._start_one(row):
                    started = True
                    break
                emptied.add(row["id"])
            if started:
                ready.append(owner)
                self._turn += 1
        for row in rows:
            if any(b == row["id"] for b, _ in self.running):
                continue
            if await asyncio.to_thread(self.store.pending, row["id"]) == 0 and await asyncio.to_thread(
                    self.store.set_status, row["id"], "finalizing", when=("in_progress",)):
                self.wake()

    async def _start_one(self, row: dict[str, Any]) -> bool:
        """Claim one line of the batch and start it; False when none is free."""
        batch_id = row["id"]
        claimed = await asyncio.to_thread(self.store.claim, batch_id, self.name, 1, CLAIM_STALE_S)
        if not claimed:
            return False
        line = claimed[0]
        key = (batch_id, line["line"])
        if key in self.running:   # our own claim, gone stale while the line runs: it keeps running once
            return False
        task = asyncio.get_running_loop().create_task(self._line(row, line))
        self.running[key] = task
        task.add_done_callback(lambda t, k=key: self._done(k, t))
        return True

    def room(self) -> int:
        """How many lines may run now: `concurrency` on an idle server, `BUSY_CONCURRENCY` while
        interactive requests hold or wait for admission slots (the lines already running finish;
        no new one starts beyond that)."""
        adm = self.gw.admission
        interactive = adm.running + adm.num_waiting - self.admitting
        return min(self.concurrency, BUSY_CONCURRENCY) if interactive > 0 else self.concurrency

    def _done(self, key: tuple[str, int], task: asyncio.Task | None = None) -> None:
        if task is None or self.running.get(key) is task:   # never untrack another task of the same line
            self.running.pop(key, None)
        self.wake()

    async def _stop_lines(self, batch_id: str) -> None:
        """Cancel the batch's running lines (their leases abort the engine requests) and wait for them."""
        tasks = [t for (b, _), t in self.running.items() if b == batch_id]
        self.paid = {k for k in self.paid if k[0] != batch_id}
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(self.store.release, self.name, batch_id)

    def _write_files(self, row: dict[str, Any], status: str, when: tuple[str, ...]) -> None:
        """The output and error files (ids derived from the batch: written once), then `status`."""
        batch_id, owner = row["id"], row["owner"]
        ids: dict[str, str | None] = {}
        for state, kind in (("done", "output"), ("failed", "error")):
            text = self.store.results(batch_id, state)
            ids[kind] = None
            if text:
                ids[kind] = self.files.put(owner, "batch_output", f"{batch_id}_{kind}.jsonl", text,
                                           file_id=f"file-{batch_id.removeprefix('batch_')}-{kind}", quota=False)["id"]
        self.store.set_status(batch_id, status, when=when, output_file_id=ids["output"], error_file_id=ids["error"])

    # ---- one line ----------------------------------------------------------------------------

    async def _line(self, row: dict[str, Any], line: dict[str, Any]) -> None:
        try:
            await self._answer_line(row, line)
        except _Backoff as b:   # the slot and the claim go back; the owner's lines wait
            self.not_before[row["owner"]] = max(self.not_before.get(row["owner"], 0.0), time.monotonic() + b.wait)
            await asyncio.to_thread(self.store.release, self.name, row["id"], line["line"])
        except Exception:   # the store failed: the line goes back to pending for a later try
            logger.exception("batch %s line %d could not be written", row["id"], line["line"])
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.store.release, self.name, row["id"], line["line"])

    async def _answer_line(self, row: dict[str, Any], line: dict[str, Any]) -> None:
        record = RequestRecord(request_id=f"{row['id']}-{line['line']}", t0=time.monotonic(), method="POST",
                               path=row["endpoint"])
        status, body = await self._answer(row, record, json.loads(line["body"]), (row["id"], line["line"]))
        record.status = status
        result = line_result(line["custom_id"], record.request_id, status, body)
        self.paid.discard((row["id"], line["line"]))
        # The write runs in a thread that a cancel (stop() at shutdown) does not stop: the answer may
        # be stored after the cancel, so the task waits for it and logs what was stored before it ends.
        write = asyncio.ensure_future(asyncio.to_thread(
            self.store.finish_line, row["id"], line["line"], self.name, status == 200, result))
        try:
            stored = await asyncio.shield(write)
        except asyncio.CancelledError:
            self._logged(row, line, record, await write)
            raise
        self._logged(row, line, record, stored)

    @staticmethod
    def _logged(row: dict[str, Any], line: dict[str, Any], record: RequestRecord, stored: bool) -> None:
        if not stored:
            logger.warning("batch %s line %d was answered elsewhere; this answer is dropped", row["id"], line["line"])
        access_log.info(record.access_log_line())

    async def _answer(self, row: dict[str, Any], record: RequestRecord, body: dict[str, Any],
                      key: tuple[str, int] = ("", -1)) -> tuple[int, dict]:
        """(status, body) of one line; a 429 or 503 a later attempt can pass raises _Backoff (the
        line is tried again later, holding no slot meanwhile)."""
        try:
            await asyncio.to_thread(self._caller, row["owner"], record, key not in self.paid)
            self.paid.add(key)
            try:
                return 200, await self._run(row["endpoint"], record, body)
            except KVServeError as e:
                if e.status not in (429, 503):
                    self.paid.discard(key)
                raise
        except KVServeError as e:
            wait = getattr(e, "retry_after", None)
            if e.status in (429, 503) and wait is not None and getattr(e, "should_retry", True) is not False:
                raise _Backoff(min(max(wait, 0.1), MAX_RETRY_WAIT_S)) from None
            return e.status, e.to_dict()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("batch %s: a line failed", row["id"])
            return 500, INTERNAL_ERROR

    def _caller(self, owner: str, record: RequestRecord, take_request: bool = False) -> None:
        """The batch owner's key on the line's record, as the auth gate sets it (checked again each
        line: a revoked key's batch stops being served), and, with `take_request`, one token of the
        key's requests-per-minute bucket, as every request takes. The --api-key key (`api-key`) and
        a database key of that name (`db:api-key` at the gate) stay two distinct owners."""
        if not owner.startswith("key:"):
            return
        name = owner[4:]
        if name == CLI_KEY_NAME:
            key = ApiKey(name=CLI_KEY_NAME, tier="paid") if self.gw.settings.api_key else None
        else:
            at, keys = self._keys
            if time.monotonic() - at > 5.0:
                keys = {k.name: k for k in self.gw.keystore.list()}
                self._keys = (time.monotonic(), keys)
            key = keys.get(CLI_KEY_NAME if name == LEGACY_DB_CLI_NAME else name)
            if key is not None and name == LEGACY_DB_CLI_NAME:
                key = dataclasses.replace(key, name=LEGACY_DB_CLI_NAME)
        if key is None or key.revoked_at is not None:
            raise AuthenticationError(f"The key {name!r} that created this batch is revoked or gone.")
        record.key, record.key_name, record.key_tier = key, key.name, key.tier
        if take_request and self.gw.limiter is not None:
            self.gw.limiter.acquire_request(key.name, key.rpm)

    async def _run(self, endpoint: str, record: RequestRecord, body: dict[str, Any]) -> dict:
        if endpoint == "/v1/embeddings":
            return await self._embed(record, body)
        chat = endpoint == "/v1/chat/completions"
        req = validate_body(body, ChatCompletionRequest if chat else CompletionRequest)
        if req.stream:
            raise InvalidRequest("A batch request cannot stream; drop `stream`.", param="stream")
        gen = Generation.start(await build_plan(self.gw, record, req, "chat" if chat else "completion"))
        gen.plan.priority += BATCH_PRIORITY
        self.admitting += 1
        try:
            lease = await Lease.acquire(self.gw, gen, record, _never)
            await run_to_end(self.gw, gen, lease, _never)
        finally:
            self.admitting -= 1
        return OpenAIRenderer(gen, TokenTexts(gen.plan.model.tokenizer)).body()

    async def _embed(self, record: RequestRecord, body: dict[str, Any]) -> dict:
        """An embeddings line: /v1/embeddings' body (floats), the encoder charged to the key."""
        req = validate_body(body, EmbeddingRequest)
        name = self.gw.routing.embedder.name
        if req.model not in (None, "", name):
            raise InvalidRequest(f"The model {req.model!r} is not an embedding model of this server; use {name!r}.",
                                 param="model")
        texts = [req.input] if isinstance(req.input, str) else req.input
        check_texts(texts, "input")
        vecs, tokens = await charged_encode(self.gw, record, texts, use="batch")
        return {"object": "list", "model": name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "data": [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vecs)]}
