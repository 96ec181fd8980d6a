"""A/B of input moderation's cost in the server's own trace: `PYTHONPATH=src python scripts/moderation_trace_ab.py`.

Starts `kvserve serve` with two keys (moderation on / a policy with it off) and sends the same
prompt alternately with `kvserve_trace`, printing each request's timings and moderation checks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import httpx

from kvserve.bench.common import wait_healthy
from kvserve.bench.moderation import PROMPT
from kvserve.bench.serve_launch import free_port
from kvserve.server.stores.keys import KeyStore
from kvserve.server.stores.moderation_policies import PolicyStore


def main(requests: int = 8) -> None:
    data = tempfile.mkdtemp()
    db = os.path.join(data, "kvserve.db")
    store = KeyStore(db)
    keys = {"on": store.create("on"), "off": store.create("off")}
    store.close()
    policies = PolicyStore(db)
    policies.set("off", {"mode": "off", "pii_output": "off"})
    policies.close()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with open(os.path.join(data, "log"), "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvserve.server", "serve", "--port", str(port),
                                 "--data-dir", data], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(base)
        for i in range(requests):
            arm = ("on", "off")[i % 2]
            body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, "temperature": 0,
                    "kvserve_trace": True}
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=600,
                           headers={"Authorization": f"Bearer {keys[arm]}"})
            tr = r.json()["kvserve_trace"]
            print(arm, tr["timings_ms"], "cached", tr["cached_prompt_tokens"], tr.get("moderation"))
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
