"""The batch runner's share of the engine (server/api/batch_runner.py): its full
concurrency on an idle server, one line while interactive requests are admitted."""

from __future__ import annotations

from types import SimpleNamespace

from kvserve.server.api.batch_runner import BUSY_CONCURRENCY, BatchRunner


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
