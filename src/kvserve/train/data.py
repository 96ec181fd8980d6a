"""Training text: the bundled corpus, a train/held-out split, and packing into fixed-length rows.

Packing (as in GPT-2 / nanoGPT pretraining): every document is tokenized, followed by
<|endoftext|>, and all of them are laid end to end in one long id stream. A batch is B
windows of T+1 consecutive ids (inputs = window[:-1], targets = window[1:]), taken in order:

    stream  | doc 0 ......<eot> doc 1 ...<eot> doc 2 .........<eot> doc 3 ...
    step 0  |[ row 0      ][ row 1      ][ row 2      ][ row 3      ]        (B=4, global)
    step 1  |                                                        [ row 0 ...

The only data state is `position` (the index of the next row), so resuming is exact. With
data parallelism each rank takes a contiguous slice of the global batch's rows, so W ranks of
B/W rows see exactly the rows one process with B rows would.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.errors import InvalidRequest

BUNDLED_CORPUS = Path(__file__).parent / "data" / "kjv.txt.gz"
TEXT_SUFFIXES = (".txt", ".md", ".gz", ".text", ".rst", ".jsonl")


def _read(path: Path) -> str:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    if path.name.endswith((".jsonl", ".jsonl.gz")):   # `kvserve data clean` output: {"text": ...} per line
        docs = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    docs.append(json.loads(line)["text"])
                except (ValueError, KeyError, TypeError):
                    raise InvalidRequest(f"{path}:{n} is not a JSON object with \"text\"", param="corpus") from None
        text = "\n\n".join(docs)
    return text


def load_corpus(path: str | Path | None = None, max_chars: int | None = None) -> str:
    """The text of a file, of every text file under a directory (sorted), or the bundled corpus.
    JSON Lines files (`kvserve data clean` output) contribute their "text" fields, one document each."""
    p = Path(path).expanduser() if path else BUNDLED_CORPUS
    if p.is_file():
        text = _read(p)
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        if not files:
            raise InvalidRequest(f"{p} holds no text files ({', '.join(TEXT_SUFFIXES)})", param="corpus")
        text = "\n\n".join(_read(f) for f in files)
    else:
        raise InvalidRequest(f"corpus {p} does not exist: give a text file or a directory of them",
                             param="corpus")
    if not text.strip():
        raise InvalidRequest(f"corpus {p} is empty", param="corpus")
    return text[:max_chars] if max_chars else text


def split_documents(text: str, heldout_every: int = 50) -> tuple[list[str], list[str]]:
    """Documents are blank-line separated paragraphs; every `heldout_every`-th is held out."""
    docs = [d.strip() for d in text.split("\n\n") if d.strip()]
    if len(docs) < 2:
        # one long document: hold out its tail instead
        cut = max(1, len(text) * (heldout_every - 1) // heldout_every)
        return [text[:cut]], [text[cut:]]
    held = [d for i, d in enumerate(docs) if i % heldout_every == heldout_every - 1]
    train = [d for i, d in enumerate(docs) if i % heldout_every != heldout_every - 1]
    return train, held or [train.pop()]


def tokenize_documents(tokenizer, docs: list[str], eot_id: int) -> torch.Tensor:
    """One flat int64 stream: doc0 <eot> doc1 <eot> ... (batched through tokenizers' Rust side)."""
    out: list[int] = []
    for enc in tokenizer.hf.encode_batch(docs, add_special_tokens=False):
        out.extend(enc.ids)
        out.append(eot_id)
    return torch.tensor(out, dtype=torch.long)


@dataclass
class PackedBatches:
    """Fixed-length rows over a token stream, taken in order; wraps around at the end (an epoch)."""

    ids: torch.Tensor          # flat [N]
    seq_len: int
    position: int = 0          # the next row to hand out (global, across ranks)

    def __post_init__(self) -> None:
        self.num_rows = (len(self.ids) - 1) // self.seq_len
        if self.num_rows < 1:
            raise InvalidRequest(f"corpus has {len(self.ids)} tokens, fewer than one row of "
                                 f"{self.seq_len + 1}; use more text or a smaller --seq-len", param="corpus")

    def row(self, i: int) -> torch.Tensor:
        s = (i % self.num_rows) * self.seq_len
        return self.ids[s:s + self.seq_len + 1]

    def next_batch(self, global_batch: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the next global batch: (inputs [b, T], targets [b, T])."""
        if global_batch % world_size:
            raise InvalidRequest(f"batch size {global_batch} is not divisible by {world_size} processes",
                                 param="batch_size")
        per = global_batch // world_size
        first = self.position + rank * per
        rows = torch.stack([self.row(first + j) for j in range(per)])
        self.position += global_batch
        return rows[:, :-1], rows[:, 1:]
