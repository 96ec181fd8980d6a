"""Shared, session-scoped runs: one tiny tokenizer and one tiny pretraining run on the bundled corpus,
reused by the SFT / DPO / GRPO / export tests (each stage test then takes seconds)."""

from __future__ import annotations

import pytest
import torch

from kvserve.train.data import load_corpus, split_documents
from kvserve.train.pretrain import PretrainConfig, pretrain
from kvserve.train.tokenizer_train import save_tokenizer, train_tokenizer

CORPUS_CHARS = 400_000


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    # the machine is shared: one intra-op thread keeps runs small and the results deterministic
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    train, _ = split_documents(load_corpus(max_chars=CORPUS_CHARS))
    return save_tokenizer(train_tokenizer(train, vocab_size=512), tmp_path_factory.mktemp("tok"))


def tiny_pretrain_config(tok_dir, out, **kw) -> PretrainConfig:
    base = {"size": "nano", "seq_len": 64, "batch_size": 32, "max_steps": 200, "lr": 5e-3, "warmup_steps": 10,
            "eval_every": 100, "eval_windows": 16, "max_chars": CORPUS_CHARS, "checkpoint_every": 100}
    return PretrainConfig(tokenizer=str(tok_dir), out=str(out), **(base | kw))


@pytest.fixture(scope="session")
def pretrain_config():
    return tiny_pretrain_config


@pytest.fixture(scope="session")
def base_run(tok_dir, tmp_path_factory):
    """A nano model pretrained for 200 steps (~30 s): the starting point of every later stage."""
    return pretrain(tiny_pretrain_config(tok_dir, tmp_path_factory.mktemp("base")))
