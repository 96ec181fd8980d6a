"""The Ray cluster around the replicas (engine/ray_client.py): checking the requested pools,
starting a local cluster that lives as long as the client, and keeping the server's own signal
handling once Ray is in the process."""

from __future__ import annotations

import signal
import threading
import time

from kvserve.errors import InvalidRequest, ModelLoadError


def parse_replicas(value: int | str) -> tuple[int, int]:
    """`--replicas`: N (N replicas, healed) or MIN:MAX (scaled between the two)."""
    if isinstance(value, int) and not isinstance(value, bool):
        lo = hi = value
    elif isinstance(value, str) and value.strip():
        parts = value.split(":")
        try:
            lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
        except ValueError:
            lo = hi = None
        if lo is None:
            raise InvalidRequest(f"replicas must be N or MIN:MAX, got {value!r}", param="replicas")
    else:
        raise InvalidRequest(f"replicas must be N or MIN:MAX, got {value!r}", param="replicas")
    if lo < 1 or hi < lo:
        raise InvalidRequest(f"replicas must be at least 1 and MIN at most MAX, got {value!r}", param="replicas")
    return lo, hi


def check_pools(replicas: int | str, prefill_replicas: int, decode_replicas: int, engine_process: bool = False) -> None:
    """One-line errors for replica counts that cannot run."""
    replicas = parse_replicas(replicas)[1]
    for name, v in (("replicas", replicas), ("prefill_replicas", prefill_replicas),
                    ("decode_replicas", decode_replicas)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0 or (name == "replicas" and v < 1):
            raise InvalidRequest(f"{name} must be a {'positive' if name == 'replicas' else 'non-negative'} "
                                 f"integer, got {v!r}", param=name)
    if (prefill_replicas > 0) != (decode_replicas > 0):
        raise InvalidRequest("disaggregated serving needs both pools: give --prefill-replicas and "
                             "--decode-replicas at least 1 each", param="prefill_replicas")
    if prefill_replicas and replicas > 1:
        raise InvalidRequest("give either --replicas or --prefill-replicas/--decode-replicas, not both",
                             param="replicas")
    if engine_process:
        raise InvalidRequest("--engine-process does not apply to Ray replicas (each already runs in its own "
                             "process)", param="engine_process")


HEAD_THREAD_DONE = threading.Event()


LOCAL_CLUSTER = {"_node_ip_address": "127.0.0.1", "dashboard_host": "127.0.0.1", "include_dashboard": False}


def start_local_cluster(num_cpus: int) -> None:
    """Start a local Ray cluster from a thread that lives until the client shuts down. Ray starts
    its head processes with PR_SET_PDEATHSIG, which fires when the *thread* that started them
    ends, and the server builds its engine client on a loading thread that ends once loaded.
    The cluster is this machine's alone: its node address (GCS, raylet, object manager) and any
    dashboard are pinned to loopback (`LOCAL_CLUSTER`), never the machine's network address."""
    import ray

    started: list[BaseException | None] = []

    def run() -> None:
        try:
            ray.init(num_cpus=num_cpus, **LOCAL_CLUSTER)
            started.append(None)
        except BaseException as e:   # noqa: BLE001 - handed to the caller
            started.append(e)
            return
        HEAD_THREAD_DONE.wait()

    HEAD_THREAD_DONE.clear()
    thread = threading.Thread(target=run, name="kvserve-ray-head", daemon=True)
    thread.start()
    while not started and thread.is_alive():
        time.sleep(0.05)
    if not started or started[0] is not None:
        raise ModelLoadError(f"could not start a local Ray cluster: {started[0] if started else 'unknown error'}")


def reclaim_signals() -> None:
    """Ray's core worker installs a C-level SIGTERM/SIGINT handler in the driver that aborts the
    process; re-register this process's own Python handlers (the server's graceful shutdown) on
    top of it. Only the main thread may, and the server starts its engine client there."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        handler = signal.getsignal(sig)
        if handler is not None:
            signal.signal(sig, handler)
