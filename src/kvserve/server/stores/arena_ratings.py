"""Arena ratings from pairwise votes: Bradley-Terry with bootstrap intervals, and online Elo.

Bradley-Terry (as LMSYS's Chatbot Arena computes it, "compute_mle_elo"): every model has a
strength β, and P(A beats B) = σ(β_A − β_B). β is the maximum-likelihood fit over all votes,
a tie counting as half a win each way (LMSYS duplicates the battles and scores a tie once as a
win and once as a loss; "both bad" is a tie too). The fit is Newton's method on the logistic
log-likelihood with a weak Gaussian prior (λ = 0.01, sd 10 nats ≈ 1,700 points) so a model
that won every vote still gets a finite rating. Ratings are on the Elo scale,

    rating = 1000 + 400 · β / ln 10       (β centered to mean 0)

so a 400-point gap means 10:1 odds. The 95% interval of each rating is the 2.5th-97.5th
percentile over `rounds` bootstrap resamples of the votes (with replacement).

The Elo column is the online Elo of the same votes in the order they were cast (K = 4, as
LMSYS), which depends on that order; Bradley-Terry does not.
"""

from __future__ import annotations

import math

import numpy as np

SCORES = {"a": 1.0, "b": 0.0, "tie": 0.5, "both_bad": 0.5}
SCALE = 400.0 / math.log(10.0)
INIT = 1000.0


def fit_bradley_terry(a: np.ndarray, b: np.ndarray, score: np.ndarray, num_models: int,
                      prior: float = 0.01, iters: int = 100) -> np.ndarray:
    """β per model from battles (index of A, index of B, A's score in {1, 0.5, 0}), mean 0."""
    beta = np.zeros(num_models)
    if len(a) == 0:
        return beta
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(beta[a] - beta[b])))
        resid = score - p
        grad = np.bincount(a, resid, num_models) - np.bincount(b, resid, num_models) - prior * beta
        w = p * (1 - p)
        hess = np.zeros((num_models, num_models))
        np.add.at(hess, (a, a), w)
        np.add.at(hess, (b, b), w)
        np.add.at(hess, (a, b), -w)
        np.add.at(hess, (b, a), -w)
        hess[np.diag_indices(num_models)] += prior
        step = np.linalg.solve(hess, grad)
        beta += step
        if np.max(np.abs(step)) < 1e-9:
            break
    return beta - beta.mean()


def online_elo(a: np.ndarray, b: np.ndarray, score: np.ndarray, num_models: int, k: float = 4.0) -> np.ndarray:
    rating = np.full(num_models, INIT)
    for i, j, s in zip(a, b, score):
        expect = 1.0 / (1.0 + 10 ** ((rating[j] - rating[i]) / 400.0))
        rating[i] += k * (s - expect)
        rating[j] -= k * (s - expect)
    return rating


def leaderboard(votes: list[tuple[str, str, str]], rounds: int = 200, seed: int = 0) -> list[dict]:
    """Rows sorted by rating: model, rating, ci_lower, ci_upper, elo, battles, wins, ties, losses.
    `votes` are (model A, model B, winner) with winner in a | b | tie | both_bad, oldest first."""
    models = sorted({m for v in votes for m in v[:2]})
    if not models:
        return []
    index = {m: i for i, m in enumerate(models)}
    a = np.array([index[v[0]] for v in votes], dtype=np.int64)
    b = np.array([index[v[1]] for v in votes], dtype=np.int64)
    score = np.array([SCORES[v[2]] for v in votes])
    m = len(models)
    rating = INIT + SCALE * fit_bradley_terry(a, b, score, m)
    rng = np.random.default_rng(seed)
    boot = np.empty((rounds, m))
    for r in range(rounds):
        idx = rng.integers(0, len(votes), len(votes))
        boot[r] = INIT + SCALE * fit_bradley_terry(a[idx], b[idx], score[idx], m)
    lower, upper = np.percentile(boot, [2.5, 97.5], axis=0)
    elo = online_elo(a, b, score, m)
    rows = []
    for i, name in enumerate(models):
        mine = np.concatenate([score[a == i], 1 - score[b == i]])
        rows.append({"model": name, "rating": round(float(rating[i]), 1), "ci_lower": round(float(lower[i]), 1),
                     "ci_upper": round(float(upper[i]), 1), "elo": round(float(elo[i]), 1),
                     "battles": len(mine), "wins": int((mine == 1).sum()), "ties": int((mine == 0.5).sum()),
                     "losses": int((mine == 0).sum())})
    rows.sort(key=lambda r: -r["rating"])
    for rank, row in enumerate(rows, 1):
        row["rank"] = rank
    return rows
