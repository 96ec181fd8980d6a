"""The semantic cache's embedding head (train/cache_head.py trains it; server/data/cache_head.npz is
the default): a small residual MLP that maps MiniLM's vectors to a space where paraphrases sit at
cosine >= 0.95 (docs/routing.md)."""

from __future__ import annotations

import functools
import hashlib
import io
import pathlib

import numpy as np

from kvserve.errors import InvalidRequest

HEAD_PATH = pathlib.Path(__file__).parents[1] / "data" / "cache_head.npz"   # server/data/ (package data)


class CacheHead:
    """The embedding head: v + w2 gelu(w1 v + b1) + b2, normalized (train/cache_head.py)."""

    def __init__(self, arrays: dict[str, np.ndarray], digest: str):
        self.w1, self.b1, self.w2, self.b2 = (np.asarray(arrays[k], dtype=np.float32) for k in ("w1", "b1", "w2", "b2"))
        self.digest = digest
        if not (self.w1.shape[0] == self.b1.shape[0] == self.w2.shape[1] and
                self.w2.shape[0] == self.b2.shape[0] == self.w1.shape[1]):
            raise ValueError(f"inconsistent shapes {self.w1.shape} {self.b1.shape} {self.w2.shape} {self.b2.shape}")

    @property
    def dim(self) -> int:
        return self.w1.shape[1]

    def project(self, vectors: np.ndarray) -> np.ndarray:
        """Unit rows (or one unit vector) in the head's space."""
        v = np.asarray(vectors, dtype=np.float32)
        h = v @ self.w1.T + self.b1
        h = 0.5 * h * (1.0 + np.tanh(0.7978845608028654 * (h + 0.044715 * h ** 3)))
        out = v + h @ self.w2.T + self.b2
        return out / np.maximum(np.linalg.norm(out, axis=-1, keepdims=True), 1e-12)


@functools.lru_cache(maxsize=8)
def load_head(spec: str) -> CacheHead | None:
    """The head named by the `head` option: "default" (the shipped one), "none", or an npz path."""
    if not isinstance(spec, str) or not spec:
        raise InvalidRequest(f"semantic_cache: \"head\" must be \"default\", \"none\" or a file path, not {spec!r}",
                             param="semantic_cache")
    if spec == "none":
        return None
    path = HEAD_PATH if spec == "default" else pathlib.Path(spec)
    try:
        data = path.read_bytes()
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            head = CacheHead({k: z[k] for k in ("w1", "b1", "w2", "b2")}, hashlib.sha256(data).hexdigest()[:16])
        if not all(np.isfinite(a).all() for a in (head.w1, head.b1, head.w2, head.b2)):
            raise ValueError("non-finite weights")
        return head
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidRequest(f"semantic_cache: cannot load the embedding head {str(path)!r}: {e}",
                             param="semantic_cache") from None
