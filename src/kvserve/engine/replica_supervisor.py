"""ReplicaSupervisor: keeps a RayClient's replicas serving (healing) and sized to the load (scaling).

    kvserve serve --replicas 2                         two replicas, each restarted when it dies
    kvserve serve --replicas 1:3 --target-ttft-ms 500  one to three, on queue depth and TTFT

A replica slot goes through these states (`Replica.state`, shown by /health and /metrics):

    starting -> serving -> draining -> stopped        (scaled down)
                serving -> dead -> starting            (healed)

Healing: a replica whose actor died (the client's reader saw its poll fail; its requests were
moved or ended there) is started again in the same slot after a backoff that doubles from
`backoff[0]` to `backoff[1]` seconds, at most `max_restarts` times within `restart_window` seconds;
past that the slot stays dead and the log says why. A new incarnation is a new Replica object,
so a late message from the old actor's reader never speaks for the new one.

Scaling (only when max > min, and only plain replicas, not disaggregated pools): once per
`interval`, the supervisor reads the serving replicas' waiting queues (from their stats) and the
median time to first token of the requests whose first token came in the last `window` seconds
(the client records it). Pressure is a median above `target_ttft_ms` or more than
`queue_per_replica` requests waiting per serving replica; `up_after` ticks of pressure in a row
start one more replica (one start at a time, up to max). With nothing in flight and nothing
waiting for `idle_down` seconds, the newest serving replica above min drains: the router sends it
nothing new, what it holds finishes, then its actor stops. A drained slot is reused first.

Runs on the client's event loop; starting an actor (seconds: it loads the model) runs in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import msgspec

logger = logging.getLogger("kvserve.engine")


@dataclass
class Replica:
    """One incarnation of a replica slot of engine/ray_client.py's RayClient."""

    index: int
    actor: object
    role: str               # "serve", "prefill" or "decode"
    pid: int = 0
    alive: bool = True      # its outputs count: serving or draining
    state: str = "serving"  # starting | serving | draining | stopped | dead
    stats: dict = field(default_factory=dict)
    reader: threading.Thread | None = None


class ReplicaSupervisor:
    def __init__(self, client, *, min_replicas: int, max_replicas: int, target_ttft_ms: float | None = None,
                 idle_down: float = 60.0, interval: float = 1.0, window: float = 10.0, queue_per_replica: int = 2,
                 up_after: int = 2, max_restarts: int = 5, restart_window: float = 600.0,
                 backoff: tuple[float, float] = (1.0, 30.0), start_timeout: float = 900.0):
        self.client = client
        self.min, self.max = min_replicas, max(max_replicas, min_replicas)
        self.scales = self.max > self.min and not client.disaggregated
        self.target_ttft = target_ttft_ms / 1000 if target_ttft_ms else None
        self.idle_down, self.interval, self.window = idle_down, interval, window
        self.queue_per_replica, self.up_after = queue_per_replica, up_after
        self.max_restarts, self.restart_window, self.backoff = max_restarts, restart_window, backoff
        self.start_timeout = start_timeout
        self.restarts: dict[int, list[float]] = defaultdict(list)
        self.num_restarts = 0
        self.num_scaled_up = 0
        self.num_scaled_down = 0
        self._pressure = 0
        self._busy_at = time.monotonic()
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        for t in [self._loop_task, *self._tasks]:
            if t is not None:
                t.cancel()
        for t in [self._loop_task, *self._tasks]:
            if t is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    def _spawn_task(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def healing(self) -> bool:
        """A slot is starting, or dead and due to start again: the client is not gone for good."""
        return any(r.state == "starting" or (r.state == "dead" and self._may_restart(r.index))
                   for r in self.client.replicas)

    # ---- healing ------------------------------------------------------------------------------
    def _may_restart(self, index: int) -> bool:
        now = time.monotonic()
        return len([t for t in self.restarts[index] if now - t < self.restart_window]) < self.max_restarts

    def replica_died(self, index: int) -> bool:
        """On the event loop, from the client: schedule the slot's restart. False past the limit."""
        now = time.monotonic()
        recent = [t for t in self.restarts[index] if now - t < self.restart_window]
        if len(recent) >= self.max_restarts:
            logger.error("engine replica %d died %d times within %.0f s: not restarting it again", index,
                         len(recent), self.restart_window)
            return False
        delay = min(self.backoff[1], self.backoff[0] * 2 ** len(recent))
        self.restarts[index] = [*recent, now]
        logger.warning("engine replica %d: restarting in %.0f s (restart %d of at most %d within %.0f s)", index,
                       delay, len(recent) + 1, self.max_restarts, self.restart_window)
        self._spawn_task(self._restart(index, delay))
        return True

    async def _restart(self, index: int, delay: float) -> None:
        await asyncio.sleep(delay)
        rep = self.client.replicas[index]
        if rep.state == "dead" and not self.client._closing and await self._bring_up(index, rep.role):
            self.num_restarts += 1

    async def _bring_up(self, index: int, role: str) -> bool:
        """Start a replica in slot `index` (new or reused) and put it in rotation once it has loaded."""
        client = self.client
        placeholder = Replica(index, None, role, alive=False, state="starting")
        client.router.slot(index)
        if index < len(client.replicas):
            client.replicas[index] = placeholder
        else:
            client.replicas.append(placeholder)
        try:
            actor, pid, stats = await asyncio.to_thread(self._start_actor, index, role)
        except Exception as e:   # noqa: BLE001 - RayActorError, GetTimeoutError...: the slot is dead again
            logger.error("engine replica %d could not start: %s", index, str(e).strip().splitlines()[-1:] or e)
            placeholder.state = "dead"
            if not client._closing and not self.replica_died(index) and not client._serving():
                client._fail_all("every engine replica is gone and none could be restarted")
            return False
        if client._closing or client.replicas[index] is not placeholder:
            self._kill(actor)
            return False
        rep = Replica(index, actor, role, pid, stats=stats)
        client.replicas[index] = rep
        client.router.revive(index)
        client.note_tier(index, stats)
        client.start_reader(rep)
        logger.info("engine replica %d (pid %d) is serving", index, pid)
        return True

    def _start_actor(self, index: int, role: str):
        """In a thread: a new actor, loaded (ready), with its pid and first stats."""
        import ray

        actor = self.client.spawn(index, role)
        try:
            ray.get(actor.ready.remote(), timeout=self.start_timeout)
            pid = ray.get(actor.pid.remote(), timeout=60)
            stats = msgspec.msgpack.decode(ray.get(actor.stats.remote(), timeout=60))
        except BaseException:
            self._kill(actor)
            raise
        return actor, pid, stats

    @staticmethod
    def _kill(actor) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(actor)

    # ---- scaling ------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.tick(time.monotonic())
            except Exception:   # a bug here must not stop healing or serving
                logger.exception("replica supervisor tick failed")

    def recent_ttft(self, now: float) -> float | None:
        recent = [ttft for when, ttft in self.client.recent_ttft if now - when <= self.window]
        return statistics.median(recent) if recent else None

    def tick(self, now: float) -> None:
        client = self.client
        for rep in client.replicas:
            if rep.state == "draining" and client.router.replicas[rep.index].in_flight == 0 and not any(
                    w == rep.index for w in client._where.values()):
                self._spawn_task(self._stop_replica(rep))
        if not self.scales:
            return
        serving = [r for r in client.replicas if r.state == "serving"]
        starting = any(r.state == "starting" for r in client.replicas)
        active = [r for r in client.replicas if r.state in ("serving", "starting", "draining")
                  or (r.state == "dead" and self._may_restart(r.index))]
        waiting = sum(int(r.stats.get("num_requests_waiting", 0) or 0) for r in serving)
        in_flight = sum(client.router.replicas[r.index].in_flight for r in serving)
        ttft = self.recent_ttft(now)
        pressure = (self.target_ttft is not None and ttft is not None and ttft > self.target_ttft) or (
            waiting > self.queue_per_replica * max(1, len(serving)))
        self._pressure = self._pressure + 1 if pressure else 0
        if in_flight or waiting:
            self._busy_at = now
        if self._pressure >= self.up_after and not starting and len(active) < self.max:
            index = next((r.index for r in client.replicas if r.state == "stopped"), len(client.replicas))
            logger.info("scaling up to %d replicas (TTFT median %s, %d waiting): starting replica %d",
                        len(active) + 1, "n/a" if ttft is None else f"{ttft * 1000:.0f} ms", waiting, index)
            self._pressure = 0
            self.num_scaled_up += 1
            self._spawn_task(self._bring_up(index, "serve"))
        elif (not pressure and now - self._busy_at >= self.idle_down and not starting
              and len(serving) > self.min and not any(r.state == "draining" for r in client.replicas)):
            victim = max(serving, key=lambda r: r.index)
            logger.info("idle for %.0f s: draining replica %d (%d serving)", now - self._busy_at, victim.index,
                        len(serving))
            victim.state = "draining"
            client.router.drain(victim.index)
            self.num_scaled_down += 1
            self._busy_at = now        # one step down per idle period

    async def _stop_replica(self, rep) -> None:
        """A drained replica (nothing in flight): stop its engine, then its actor."""
        import ray

        if rep.state != "draining":
            return
        rep.state = "stopped"
        rep.alive = False
        self.client.router.mark_dead(rep.index)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(ray.get, rep.actor.shutdown.remote(), timeout=15)
        self._kill(rep.actor)
        logger.info("engine replica %d stopped (drained)", rep.index)

    def stats(self) -> dict:
        return {"replica_restarts": self.num_restarts, "replica_scale_ups": self.num_scaled_up,
                "replica_scale_downs": self.num_scaled_down}
