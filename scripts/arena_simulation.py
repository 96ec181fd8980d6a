"""Arena ratings check: 100 runs of 1,000 simulated votes with planted strengths (BENCHMARKS.md, issue 21)."""

import pathlib
import sys

import numpy as np

from kvserve.server.stores.arena_ratings import leaderboard

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "server"))
from test_arena import PLANTED, simulate


def main() -> None:
    center = 1000 - np.mean(list(PLANTED.values()))
    order = covered = total = 0
    for seed in range(100):
        rows = leaderboard(simulate(1000, seed), rounds=200, seed=seed)
        order += [r["model"] for r in rows] == sorted(PLANTED, key=lambda m: -PLANTED[m])
        for r in rows:
            total += 1
            covered += r["ci_lower"] <= PLANTED[r["model"]] + center <= r["ci_upper"]
    print(f"planted order recovered in {order}/100 runs; intervals cover the planted rating {covered}/{total}")


if __name__ == "__main__":
    main()
