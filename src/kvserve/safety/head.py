"""The moderation head: one small classifier per category over the request's sentence embedding.

The features are all-MiniLM-L6-v2's 384-dim unit embedding (model/bert.py), the one the semantic
cache and the router already compute for a chat request (server/routing/embedder.py), or, for a
head saved with `layers`, the unit mean-pooled states after each of those layers of the same one
forward, concatenated (`features`): the last layer is tuned for sentence similarity, which keeps
a text's topic more than what it asks for, and the layers below it add the rest at no cost. The head
is a one-hidden-layer MLP shared by the categories (`hidden` units, ReLU) with one sigmoid output
per category, or a plain logistic regression per category when `hidden` is 0; `train.py` fits it
on the public sets of datasets.py and picks each category's threshold on their validation split.
Serving needs numpy only: two small matrix products per window (microseconds).

A text longer than the encoder's 256 tokens is judged over windows of all of it (`windows`): a
category's score is its largest over the windows, so harm at the end of a long message counts.
"""

from __future__ import annotations

import functools
import pathlib
import re

import numpy as np

from kvserve.safety.datasets import OUTPUTS

HEAD_PATH = pathlib.Path(__file__).with_name("data") / "head.npz"
WINDOW_CHARS = 320      # about 70 tokens: a sentence or three, so one harmful sentence is not averaged away
OVERLAP_CHARS = 120     # so a sentence cut by one window is whole in the next


_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+|\n+")
GROUP_CHARS = 100       # a long text's short sentences are packed into groups of at most this much


def _pieces(text: str, size: int, overlap: int) -> list[str]:
    """`text` cut at whitespace into pieces of about `size` characters overlapping by `overlap`."""
    out, start = [], 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            cut = text.rfind(" ", start + size // 2, end)
            end = cut if cut > 0 else end
        out.append(text[start:end])
        if end >= len(text):
            break
        nxt = text.find(" ", max(start + 1, end - overlap), end)
        start = nxt + 1 if nxt > 0 else end
    return out


def windows(text: str, size: int = WINDOW_CHARS, overlap: int = OVERLAP_CHARS) -> list[str]:
    """What a check embeds: `text` itself when short, else its sentences packed into groups of
    at most GROUP_CHARS (most sentences alone; a sentence longer than `size` cut into overlapping
    pieces), covering all of it. Short groups, because a sentence-embedding is a mean over the window's tokens: one
    harmful sentence among many harmless ones would be averaged away."""
    if len(text) <= size:
        return [text]
    out: list[str] = []
    group = ""
    for sent in _SENTENCE_END.split(text):
        sent = sent.strip()
        if not sent:
            continue
        if len(sent) > size:
            if group:
                out.append(group)
                group = ""
            out += _pieces(sent, size, overlap)
        elif len(group) + len(sent) + 1 > GROUP_CHARS and group:
            out.append(group)
            group = sent
        else:
            group = f"{group} {sent}" if group else sent
    if group:
        out.append(group)
    return out or [text[:size]]


def train_text(text: str) -> str:
    """What the head is trained on for a labelled text: its first 800 characters."""
    return _pieces(text, 800, 200)[0] if len(text) > 800 else text


class Head:
    def __init__(self, arrays: dict[str, np.ndarray]):
        self.labels = tuple(str(x) for x in arrays["labels"])
        self.w1 = arrays.get("w1")
        self.b1 = arrays.get("b1")
        self.w2, self.b2 = arrays["w2"].astype(np.float32), arrays["b2"].astype(np.float32)
        if self.w1 is not None and self.w1.size:
            self.w1, self.b1 = self.w1.astype(np.float32), self.b1.astype(np.float32)
        else:
            self.w1 = None
        self.thresholds = {lab: float(t) for lab, t in zip(self.labels, arrays["thresholds"])}
        self.size_bytes = sum(int(a.nbytes) for a in arrays.values())
        # the encoder's tuned top layers (safety/tuned.py), when the head judges their vector
        # rather than the shared embedding
        self.top = {k: v for k, v in arrays.items() if k.startswith("top.")}
        # the encoder depths whose pooled states the head reads, concatenated; () = the embedding alone
        self.layers = tuple(int(d) for d in arrays.get("layers", np.zeros(0)))

    def depths(self, full_layers: int, full=None) -> tuple:
        """What to ask an encoder's `encode_depths` for, in the order `features` joins them: each
        of `layers` (the encoder's whole depth, `full_layers`, as `full`: the embedder's key for
        the shared embedding), or `(full,)` for a head over the embedding alone."""
        return tuple(full if d == full_layers else d for d in self.layers) or (full,)

    def probs(self, vectors: np.ndarray) -> np.ndarray:
        """[n, len(labels)] probabilities of n embeddings."""
        x = np.asarray(vectors, dtype=np.float32).reshape(-1, self.w2.shape[1] if self.w1 is None else self.w1.shape[1])
        if self.w1 is not None:
            x = np.maximum(x @ self.w1.T + self.b1, 0.0)
        z = x @ self.w2.T + self.b2
        return 1.0 / (1.0 + np.exp(-np.clip(z, -30, 30)))

    def scores(self, vectors: np.ndarray) -> dict[str, float]:
        """Each category's largest probability over the windows' embeddings."""
        p = self.probs(vectors).max(axis=0)
        return {lab: float(v) for lab, v in zip(self.labels, p)}


def features(vectors: dict, depths: tuple) -> np.ndarray:
    """[n, 384 * len(depths)]: the rows of `vectors` ({depth: [n, 384]}) at `depths`, side by side."""
    return np.concatenate([np.asarray(vectors[d], dtype=np.float32) for d in depths], axis=-1)


def save(path: pathlib.Path, *, w2: np.ndarray, b2: np.ndarray, thresholds: list[float],
         w1: np.ndarray | None = None, b1: np.ndarray | None = None, top: dict[str, np.ndarray] | None = None,
         layers: tuple[int, ...] = ()) -> None:
    np.savez_compressed(path, labels=np.array(OUTPUTS), w2=w2.astype(np.float16), b2=b2.astype(np.float32),
                        w1=(w1 if w1 is not None else np.zeros((0,))).astype(np.float16),
                        b1=(b1 if b1 is not None else np.zeros((0,))).astype(np.float32),
                        thresholds=np.array(thresholds, dtype=np.float32), layers=np.array(layers, dtype=np.int32),
                        **(top or {}))


def load(path: pathlib.Path | None = None) -> Head:
    with np.load(path or HEAD_PATH) as z:
        return Head({k: z[k] for k in z.files})


@functools.cache
def default_head() -> Head:
    return load()


_WS = re.compile(r"\s+")


def normalize(text: str) -> str:
    return _WS.sub(" ", text).strip()
