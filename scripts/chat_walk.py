"""Every kvserve file one default streamed chat touches, in the order it first reaches each.

    python scripts/chat_walk.py [--all]

Starts the app in this process on the embedded default model (as `kvserve serve` would, with a
throwaway data dir), sends one warm-up chat, then profiles a second streamed chat in every thread
(gateway, engine core, worker threads) and prints each file under src/kvserve/ the first time one
of its functions runs. docs/architecture.md's walk names all of them; run this after moving a
gateway or engine file to check it still does. `--all` also prints the function first seen.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile
import threading
import time

from fastapi.testclient import TestClient

import kvserve
from kvserve.server.app import create_app
from kvserve.server.settings import ServerSettings

ROOT = pathlib.Path(kvserve.__file__).parent
seen: dict[str, str] = {}
active = False


def profile(frame, event, arg) -> None:
    if active and event == "call":
        path = frame.f_code.co_filename
        if path.startswith(str(ROOT)) and path not in seen:
            seen[path] = frame.f_code.co_name


def main() -> None:
    global active
    app = create_app(None, ServerSettings(data_dir=pathlib.Path(tempfile.mkdtemp(prefix="kvserve-walk-"))))
    threading.setprofile(profile)   # threads started from here on: the portal, the engine, workers
    sys.setprofile(profile)
    with TestClient(app) as client:
        while client.get("/health").status_code != 200:
            time.sleep(0.5)
        model = client.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "stream": True, "max_tokens": 8,
                "messages": [{"role": "user", "content": "Warm up."}]}
        client.post("/v1/chat/completions", json=body).read()
        time.sleep(1)
        active = True
        body["messages"] = [{"role": "user", "content": "Say hi in three words."}]
        status = client.post("/v1/chat/completions", json=body).status_code
        time.sleep(1)   # the engine loop's last step and the access log
        active = False
    sys.setprofile(None)
    threading.setprofile(None)
    print(f"# HTTP {status}; {len(seen)} files, {sum(p.startswith(str(ROOT / 'server')) for p in seen)} in server/")
    for path, func in seen.items():
        rel = pathlib.Path(path).relative_to(ROOT)
        print(f"{rel}  {func}" if "--all" in sys.argv else rel)


if __name__ == "__main__":
    main()
