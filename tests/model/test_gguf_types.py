"""Every supported GGUF tensor type loads to the same model transformers builds from the file."""

import pytest
import torch
from ggufmaker import hf_logits, make_tiny_llama_gguf

from kvserve.model.loader import load_model

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


def _ours(path, text="hello there the world"):
    lm = load_model(str(path), weight_format="fp32")
    ids = lm.tokenizer.encode(text)
    with torch.no_grad():
        return ids, lm.model.compute_logits(lm.model(torch.tensor([ids])))[0]


@pytest.mark.parametrize("qtype", TYPES)
def test_tensor_type_matches_transformers(tmp_path, qtype):
    path = make_tiny_llama_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype=qtype)
    ids, ours = _ours(path)
    ref = hf_logits(path, ids)
    assert ref.std() > 0.5                      # a model that actually distinguishes tokens
    assert (ours - ref).abs().max().item() <= 1e-3


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", True), ("qwen2", False)])
def test_architectures_from_gguf(tmp_path, arch, tied):
    path = make_tiny_llama_gguf(tmp_path / f"tiny-{arch}.gguf", qtype="Q8_0", arch=arch, tied=tied)
    ids, ours = _ours(path)
    assert (ours - hf_logits(path, ids)).abs().max().item() <= 1e-3
