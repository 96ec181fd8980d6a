"""The Batch API's runner: every line of a batch through the same path as an interactive request
of its key, in the engine's spare capacity, resumable after a restart.

One `BatchRunner` per server (started and stopped with the app). Its loop takes the active
batches from the store (stores/batches.py) and moves each along:

    validating   the input file read and checked line by line; the lines stored and the batch
                 in_progress in one transaction (or failed, with the errors)
    in_progress  lines claimed one at a time while fewer than `room()` run (`concurrency` on an
                 idle server, one while interactive requests are admitted); each line is a
                 chat or completions request parsed as the route parses it, then build_plan (caps,
                 moderation, routing, the key's tier) → Lease.acquire (the key's token bucket, an
                 admission slot) → run_to_end → OpenAIRenderer.body(), with the plan's priority
                 pushed below every interactive request (`BATCH_PRIORITY`), so the admission queue
                 and the engine's scheduler serve interactive requests first; an embeddings line
                 goes to the encoder, charged the same way. The result (or the error, in OpenAI's
                 output-line shape) is written and the line marked done in one UPDATE.
    finalizing   no line pending: the output and error files written (ids derived from the batch,
                 so writing them again after a crash finds them), then completed
    cancelling   the batch's running lines stopped (their leases abort the engine requests), the
                 files of what was done written, then cancelled
    expired      past expires_at: pending lines failed as `batch_expired`, files written

A 429 or 503 a line meets (the key's token bucket, a full queue, the model loading) waits
Retry-After and tries again instead of failing the line. The runner's claims are refreshed while
lines run and released on shutdown (a SIGTERM), so a restarted server, or another replica on the
same PostgreSQL, resumes with exactly the lines no one answered; a killed server's claims are
free again after `CLAIM_STALE_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from kvserve.errors import AuthenticationError, InvalidRequest, KVServeError
from kvserve.server.api.embeddings import EmbeddingRequest
from kvserve.server.api.files import check_batch_lines
from kvserve.server.api.openai_wire import INTERNAL_ERROR, OpenAIRenderer
from kvserve.server.api.rerank import check_texts
from kvserve.server.gates.encoder_usage import charged_encode
from kvserve.server.generation.lease import Lease
from kvserve.server.generation.plan import build_plan
from kvserve.server.generation.run import run_to_end
from kvserve.server.generation.state import Generation
from kvserve.server.generation.trace import TokenTexts
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, validate_body
from kvserve.server.records import RequestRecord
from kvserve.server.stores.keys import ApiKey

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

    # ---- life ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="kvserve-batch-runner")

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        """Stop the loop and the running lines (their engine requests aborted), give back the claims."""
        tasks = [t for t in (self._task, *self.running.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.store.release, self.name)

    async def _loop(self) -> None:
        beat = time.monotonic()
        while True:
            try:
                for row in await asyncio.to_thread(self.store.active):
                    await self._advance(row)
                if self.running and time.monotonic() - beat > HEARTBEAT_S:
                    beat = time.monotonic()
                    await asyncio.to_thread(self.store.heartbeat, self.name, list(self.running))
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("batch runner step failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), POLL_S)
            self._wake.clear()

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
        else:
            await self._fill(row)

    def _validate(self, row: dict[str, Any]) -> None:
        owner, errors = row["owner"], []
        try:
            lines = check_batch_lines(self.files.content(owner, row["input_file_id"]))
        except KVServeError as e:
            lines, errors = [], [{"code": e.code or "invalid_file", "message": e.message, "param": e.param,
                                  "line": None}]
        for i, (_, obj) in enumerate(lines, start=1):
            if obj["url"] != row["endpoint"] and len(errors) < 100:
                errors.append({"code": "invalid_url", "message": f"The line's url {obj['url']!r} is not the batch's "
                               f"endpoint {row['endpoint']!r}.", "param": "url", "line": i})
        if errors:
            self.store.fail(row["id"], errors)
        elif self.store.start(row["id"], [(cid, json.dumps(obj["body"])) for cid, obj in lines]):
            logger.info("batch %s: %d requests in progress", row["id"], len(lines))

    async def _fill(self, row: dict[str, Any]) -> None:
        """Claim and start lines while there is room; finalize when none is left."""
        batch_id = row["id"]
        while len(self.running) < self.room():
            claimed = await asyncio.to_thread(self.store.claim, batch_id, self.name, 1, CLAIM_STALE_S)
            if not claimed:
                break
            line = claimed[0]
            task = asyncio.get_running_loop().create_task(self._line(row, line))
            self.running[(batch_id, line["line"])] = task
            task.add_done_callback(lambda _t, k=(batch_id, line["line"]): self._done(k))
        if any(b == batch_id for b, _ in self.running):
            return
        if await asyncio.to_thread(self.store.pending, batch_id) == 0 and await asyncio.to_thread(
                self.store.set_status, batch_id, "finalizing", when=("in_progress",)):
            self.wake()

    def room(self) -> int:
        """How many lines may run now: `concurrency` on an idle server, `BUSY_CONCURRENCY` while
        interactive requests hold or wait for admission slots (the lines already running finish;
        no new one starts beyond that)."""
        adm = self.gw.admission
        interactive = adm.running + adm.num_waiting - self.admitting
        return min(self.concurrency, BUSY_CONCURRENCY) if interactive > 0 else self.concurrency

    def _done(self, key: tuple[str, int]) -> None:
        self.running.pop(key, None)
        self.wake()

    async def _stop_lines(self, batch_id: str) -> None:
        """Cancel the batch's running lines (their leases abort the engine requests) and wait for them."""
        tasks = [t for (b, _), t in self.running.items() if b == batch_id]
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
        except Exception:   # the store failed: the line goes back to pending for a later try
            logger.exception("batch %s line %d could not be written", row["id"], line["line"])
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.store.release, self.name, row["id"], line["line"])

    async def _answer_line(self, row: dict[str, Any], line: dict[str, Any]) -> None:
        record = RequestRecord(request_id=f"{row['id']}-{line['line']}", t0=time.monotonic(), method="POST",
                               path=row["endpoint"])
        status, body = await self._answer(row, record, json.loads(line["body"]))
        record.status = status
        result = line_result(line["custom_id"], record.request_id, status, body)
        if not await asyncio.to_thread(self.store.finish_line, row["id"], line["line"], self.name, status == 200,
                                       result):
            logger.warning("batch %s line %d was answered elsewhere; this answer is dropped", row["id"], line["line"])
        access_log.info(record.access_log_line())

    async def _answer(self, row: dict[str, Any], record: RequestRecord, body: dict[str, Any]) -> tuple[int, dict]:
        """(status, body) of one line, retrying what a later attempt can pass (429, 503)."""
        while True:
            try:
                await asyncio.to_thread(self._caller, row["owner"], record)
                return 200, await self._run(row["endpoint"], record, body)
            except KVServeError as e:
                wait = getattr(e, "retry_after", None)
                if e.status in (429, 503) and wait is not None and getattr(e, "should_retry", True) is not False:
                    await asyncio.sleep(min(max(wait, 0.1), MAX_RETRY_WAIT_S))
                    record.t0 = time.monotonic()
                    continue
                return e.status, e.to_dict()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("batch %s: a line failed", row["id"])
                return 500, INTERNAL_ERROR

    def _caller(self, owner: str, record: RequestRecord) -> None:
        """The batch owner's key on the line's record, as the auth gate sets it (checked again each
        line: a revoked key's batch stops being served)."""
        if not owner.startswith("key:"):
            return
        name = owner[4:]
        at, keys = self._keys
        if time.monotonic() - at > 5.0:
            keys = {k.name: k for k in self.gw.keystore.list()}
            self._keys = (time.monotonic(), keys)
        key = keys.get(name)
        if key is None and name == "api-key" and self.gw.settings.api_key:   # the --api-key key
            key = ApiKey(name=name, tier="paid")
        if key is None or key.revoked_at is not None:
            raise AuthenticationError(f"The key {name!r} that created this batch is revoked or gone.")
        record.key, record.key_name, record.key_tier = key, key.name, key.tier

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
