"""Make the two models of BENCHMARKS.md's MoE-vs-dense row: a tiny random Mixtral (8 experts of FFN
width F, top-2) and a Llama with FFN width 2F, otherwise equal (same attention, layers, vocabulary):
the same active parameters per token. Both are written as GGUF (Q8_0 projections) the way
llama.cpp's converter names them, with the tests' writer (tests/model/families_gguf.py).

    python scripts/make_tiny_moe_bench.py OUT_DIR   # -> OUT_DIR/moe.gguf, OUT_DIR/dense.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model"))
from families_gguf import write_gguf

COMMON = {"vocab_size": 262, "hidden_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 8,
          "num_key_value_heads": 4, "max_position_embeddings": 1024, "initializer_range": 0.05}
FFN = 2048   # both models well past the L3 cache: decode reads its active weights from DRAM


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    moe = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        intermediate_size=FFN, num_local_experts=8, num_experts_per_tok=2, sliding_window=None, **COMMON))
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=2 * FFN, **COMMON))
    for name, model, family in (("moe", moe, "mixtral"), ("dense", dense, "mixtral")):
        ckpt = out / f"{name}-hf"
        model.save_pretrained(ckpt)
        write_gguf(ckpt, family, out / f"{name}.gguf", qtype="Q8_0")   # arch "llama" for both
        print(out / f"{name}.gguf", sum(p.numel() for p in model.parameters()), "parameters")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
