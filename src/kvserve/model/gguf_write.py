"""What every GGUF writer in kvserve does the same way with the `gguf` package's GGUFWriter: the
training export (train/gguf_export.py), the random-weight files of real shapes
(bench/gguf_random.py, bench/gguf_vocab.py) and the tests' small models."""

from __future__ import annotations

from typing import Any


def add_llama_shape(w: Any, *, name: str, layers: int, ctx: int, hidden: int, inter: int, heads: int,
                    kv_heads: int) -> None:
    """general.name and the shape keys every Llama-family file carries, in llama.cpp's converter's
    order: block count, context length, embedding and feed-forward widths, query and KV heads."""
    w.add_name(name)
    w.add_block_count(layers)
    w.add_context_length(ctx)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)


def finish(w: Any) -> None:
    """Write the header, the key/value metadata and the tensors, in that order, and close the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
