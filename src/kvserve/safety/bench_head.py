"""`python -m kvserve.safety.bench_head [N]`: input moderation's latency with the head.

* `with embedding`: Moderator.check on a chat prompt whose vector the request's forward made already;
* `branch on shared forward`: when the head ships tuned top layers (safety/tuned.py), what they add
  to the request's one forward: the forward asking for the embedding and the branch's vector, minus
  the forward asking for the embedding alone (medians of interleaved runs);
* `2000 chars alone`: a 2,000-character message embedded here (its sentence groups, one batched
  forward of the shipped encoder) and judged.
p50 and p90 in ms over N runs (default 30). Numbers depend on the machine's load: say it beside them.
"""

from __future__ import annotations

import statistics
import sys
import time


def main(argv: list[str] | None = None) -> None:
    from kvserve.model.bert import default_encoder
    from kvserve.safety.moderator import Moderator
    from kvserve.safety.tuned import attach

    n = int((argv if argv is not None else sys.argv[1:] or ["30"])[0])
    mod = Moderator()
    prompt = "What are some good ways to spend a rainy Sunday afternoon with two young kids at home?"
    _encode = mod.encode
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
    enc = default_encoder()
    branch = attach(enc, mod.head)
    if branch is not None:
        both, alone = [], []
        for _ in range(n):
            for depths, out in (((enc.layers, branch), both), ((enc.layers,), alone)):
                t0 = time.perf_counter()
                enc.encode_depths([prompt], depths)
                out.append((time.perf_counter() - t0) * 1000)
        print(f"branch on shared forward: +{statistics.median(both) - statistics.median(alone):.3f} ms p50 "
              f"(forward {statistics.median(alone):.3f} ms alone, {statistics.median(both):.3f} ms with the branch)")


if __name__ == "__main__":
    main()
