import torch

from kvserve.train.data import PackedBatches, load_corpus, split_documents


def test_bundled_corpus_split_is_disjoint_and_complete():
    text = load_corpus()
    assert len(text) > 3_000_000
    train, held = split_documents(text)
    assert len(held) == len(train) // 49 or abs(len(held) - (len(train) + len(held)) // 50) <= 1
    assert not set(train) & set(held)


def test_ranks_see_the_rows_of_the_global_batch():
    ids = torch.arange(1000)
    one = PackedBatches(ids, seq_len=8)
    two = [PackedBatches(ids, seq_len=8) for _ in range(2)]
    for _ in range(3):
        x, y = one.next_batch(4)
        parts = [two[r].next_batch(4, rank=r, world_size=2) for r in range(2)]
        assert torch.equal(x, torch.cat([p[0] for p in parts]))
        assert torch.equal(y, torch.cat([p[1] for p in parts]))
        assert torch.equal(x[:, 1:], y[:, :-1])   # targets are inputs shifted by one
    assert one.position == two[0].position == 12
