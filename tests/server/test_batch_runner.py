"""The batch runner (server/api/batch_runner.py): its full concurrency on an idle server,
one line while interactive requests are admitted; and (issue 60, on real SQLite and PostgreSQL
stores) slots round-robin between owners, heartbeats on their own task, a stale self-claim, one
request token per line and the --api-key owner."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import pytest

from kvserve.errors import Overloaded
from kvserve.server.api import batch_runner as br
from kvserve.server.api.batch_runner import BUSY_CONCURRENCY, BatchRunner
from kvserve.server.gates.ratelimit import RateLimiter
from kvserve.server.records import RequestRecord
from kvserve.server.settings import ServerSettings
from kvserve.server.stores.batches import BatchStore
from kvserve.server.stores.files import FileStore
from kvserve.server.stores.keys import KeyStore


def runner(running: int, waiting: int, admitting: int) -> BatchRunner:
    gw = SimpleNamespace(admission=SimpleNamespace(running=running, num_waiting=waiting))
    r = BatchRunner(gw, store=None, files=None, concurrency=4)
    r.admitting = admitting
    return r


def test_room_shrinks_while_interactive_requests_are_admitted():
    assert runner(0, 0, 0).room() == 4
    assert runner(3, 0, 3).room() == 4            # only the batch's own lines hold slots
    assert runner(2, 1, 3).room() == 4            # one of them still waiting for its slot
    assert runner(4, 0, 3).room() == BUSY_CONCURRENCY   # an interactive request holds a slot
    assert runner(3, 1, 3).room() == BUSY_CONCURRENCY   # ... or waits for one


# ---- issue 60: fairness, heartbeats, claims, rpm, the --api-key owner (real stores) ----------



@pytest.fixture(params=("sqlite", "postgres"))
def stores(request, tmp_path):
    target = request.getfixturevalue("postgres_server").new_database() if request.param == "postgres" \
        else tmp_path / "kvserve.db"
    batches, files, keys = BatchStore(target), FileStore(target), KeyStore(target)
    yield batches, files, keys
    for s in (batches, files, keys):
        s.close()


def real_runner(stores, concurrency: int = 4, api_key: str | None = None) -> BatchRunner:
    batches, files, keys = stores
    gw = SimpleNamespace(admission=SimpleNamespace(running=0, num_waiting=0), keystore=keys,
                         limiter=RateLimiter(), settings=ServerSettings(load_model=False, api_key=api_key))
    return BatchRunner(gw, batches, files, concurrency)


def started(store: BatchStore, owner: str, n: int) -> str:
    b = store.create(owner, "/v1/chat/completions", "file-x", "24h", 86400.0, None)
    assert store.start(b["id"], [(f"r{i}", json.dumps({"i": i})) for i in range(n)])
    return b["id"]


async def _hang(*_a) -> None:
    await asyncio.Event().wait()


def test_slots_go_round_robin_between_owners(stores, monkeypatch):
    """An older, bigger batch of one key does not take every slot: each owner with lines gets
    its turn (old code: oldest batch first, all four slots to key a)."""
    store = stores[0]
    started(store, "key:a", 20)
    started(store, "key:a", 20)
    started(store, "key:b", 20)
    r = real_runner(stores)
    monkeypatch.setattr(r, "_line", _hang)

    async def go():
        await r._fill_fair([x for x in store.active() if x["status"] == "in_progress"])
        owners = sorted(store.row(b)["owner"] for b, _ in r.running)
        for t in r.running.values():
            t.cancel()
        return owners

    assert asyncio.run(go()) == ["key:a", "key:a", "key:b", "key:b"]


def test_heartbeats_run_while_a_runner_pass_is_stuck(stores, monkeypatch):
    """A runner pass that takes longer than the claims' staleness (a big file validated, files
    written) does not let a running line's claim go stale: another runner (another gateway on
    the same database) cannot claim it again."""
    store = stores[0]
    batch_id = started(store, "key:a", 2)
    r = real_runner(stores)
    monkeypatch.setattr(br, "HEARTBEAT_S", 0.05)

    async def stuck(_rows):
        await asyncio.sleep(3600)

    monkeypatch.setattr(r, "_fill_fair", stuck)

    async def go():
        line = store.claim(batch_id, r.name, 1)[0]
        r.running[(batch_id, line["line"])] = asyncio.get_running_loop().create_task(_hang())
        r.start()
        await asyncio.sleep(0.5)
        other = await asyncio.to_thread(store.claim, batch_id, "runner-other", 2, 0.3)
        await r.stop()
        return [x["line"] for x in other]

    assert asyncio.run(go()) == [1]   # line 0 still ours; only the free line goes


def test_a_stale_self_claim_neither_runs_a_line_twice_nor_untracks_it(stores, monkeypatch):
    store = stores[0]
    batch_id = started(store, "key:a", 1)
    r = real_runner(stores)
    monkeypatch.setattr(br, "CLAIM_STALE_S", -1.0)   # every claim counts as stale
    monkeypatch.setattr(r, "_line", _hang)

    async def go():
        row = store.row(batch_id)
        assert await r._start_one(row)
        first = r.running[(batch_id, 0)]
        assert not await r._start_one(row)        # our own line again: no second task
        same = r.running[(batch_id, 0)] is first and len(r.running) == 1
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await asyncio.sleep(0)
        return same, dict(r.running)

    same, left = asyncio.run(go())
    assert same and left == {}


def test_the_api_key_owner_is_not_a_database_key_of_that_name(stores):
    """A batch of `--api-key` runs as that key, never as a database key named api-key (one from
    before the name was reserved), and that database key's batches run as it (`db:api-key`)."""
    keys = stores[2]
    with keys.db.connection() as conn:
        conn.execute("INSERT INTO api_keys (name, key_hash, prefix, tier, rpm, tpm, created_at) "
                     "VALUES ('api-key', 'legacyhash', 'legacy', 'free', 1, 10, ?)", (time.time(),))
    r = real_runner(stores, api_key="the-cli-key")
    cli, legacy = RequestRecord(request_id="1", t0=0.0, method="POST", path="/v1/chat/completions"), RequestRecord(request_id="2", t0=0.0, method="POST", path="/v1/chat/completions")
    r._caller("key:api-key", cli)
    r._caller("key:db:api-key", legacy)
    assert (cli.key_name, cli.key_tier, cli.key.rpm) == ("api-key", "paid", None)
    assert (legacy.key_name, legacy.key_tier, legacy.key.rpm) == ("db:api-key", "free", 1)
    r.gw.settings = ServerSettings(load_model=False)   # no --api-key any more: its batches stop
    with pytest.raises(Exception, match="revoked or gone"):
        r._caller("key:api-key", RequestRecord(request_id="3", t0=0.0, method="POST", path="/v1/chat/completions"))


def test_a_line_takes_one_request_token_of_its_key(stores, monkeypatch):
    """Each line takes one token of the key's requests-per-minute bucket (old code: none), and a
    line retried after a 503 does not take a second one."""
    keys = stores[2]
    keys.create("limited", rpm=2)
    r = real_runner(stores)
    row = {"id": "batch_x", "owner": "key:limited", "endpoint": "/v1/chat/completions"}

    async def overloaded(*_a):
        raise Overloaded("full", retry_after=0.5)

    monkeypatch.setattr(r, "_run", overloaded)

    async def attempt(line: int) -> float:
        with pytest.raises(br._Backoff) as e:
            await r._answer(row, RequestRecord(request_id="x", t0=0.0, method="POST", path="/v1/chat/completions"), {}, ("batch_x", line))
        return e.value.wait

    async def go():
        return [await attempt(0), await attempt(0), await attempt(1), await attempt(2)]

    waits = asyncio.run(go())
    assert waits[:3] == [0.5, 0.5, 0.5]     # line 0 twice and line 1: two tokens
    assert waits[3] > 1.0                    # line 2: the bucket is empty, a rate-limit wait


def test_an_answer_stored_after_shutdown_began_is_still_logged(stores, monkeypatch, caplog):
    """stop() at SIGTERM cancels a line while its result is being written: the write goes on in its
    thread and is stored, so the line's access-log line is written too (old code: stored without a
    200 in the log, and the restarted server's count of answered lines came up one short)."""
    store = stores[0]
    batch_id = started(store, "key:a", 1)
    r = real_runner(stores)
    writing, go_on = threading.Event(), threading.Event()
    finish = store.finish_line

    def slow_finish(*a):
        writing.set()
        go_on.wait(10)
        return finish(*a)

    async def answered(*_a):
        return 200, {"ok": True}

    monkeypatch.setattr(store, "finish_line", slow_finish)
    monkeypatch.setattr(r, "_answer", answered)

    async def go():
        line = store.claim(batch_id, r.name, 1)[0]
        task = asyncio.get_running_loop().create_task(r._line(store.row(batch_id), line))
        r.running[(batch_id, 0)] = task
        await asyncio.to_thread(writing.wait, 10)
        stopping = asyncio.get_running_loop().create_task(r.stop())
        await asyncio.sleep(0.05)
        go_on.set()
        await stopping
        return task.cancelled()

    with caplog.at_level("INFO", logger="kvserve.access"):
        assert asyncio.run(go())
    assert store.pending(batch_id) == 0 and store.results(batch_id, "done")
    assert [x for x in caplog.records if x.name == "kvserve.access" and f"{batch_id}-0" in x.getMessage()]
