"""`python -m kvserve.safety.bench_head [N]`: input moderation's latency with the head.

* `with embedding`: Moderator.check on a chat prompt whose embedding the request made already
  (what input moderation adds when the semantic cache's embedding is shared);
* `2000 chars alone`: a 2,000-character message embedded here (its sentence groups, one batched
  forward of the shipped encoder) and judged.
p50 and p90 in ms over N runs (default 30). Numbers depend on the machine's load: say it beside them.
"""

from __future__ import annotations

import statistics
import sys
import time


def main(argv: list[str] | None = None) -> None:
    from kvserve.safety.moderator import Moderator, _encode

    n = int((argv if argv is not None else sys.argv[1:] or ["30"])[0])
    mod = Moderator(engine="head")
    prompt = "What are some good ways to spend a rainy Sunday afternoon with two young kids at home?"
    vec = _encode(mod.windows(prompt))
    long = ("The committee met on Tuesday to review the budget for the new library wing, the plans for "
            "the children's reading room and the schedule of the summer events. ") * 13
    long = long[:2000]
    _encode(mod.windows(long))                       # warm
    for name, fn in (("with embedding", lambda: mod.check(prompt, vectors=vec)),
                     ("2000 chars alone", lambda: mod.check(long))):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
        times.sort()
        print(f"{name}: p50 {statistics.median(times):.3f} ms, p90 {times[int(0.9 * len(times)) - 1]:.3f} ms "
              f"({len(mod.windows(long)) if 'alone' in name else 1} windows)")


if __name__ == "__main__":
    main()
