import json

import torch

from kvserve import LLM, SamplingParams
from kvserve.model.loader import load_model
from kvserve.train.pretrain import pretrain


def test_pretraining_beats_the_unigram_baseline(base_run):
    evals = [h for h in base_run["history"] if h["kind"] == "eval"]
    assert evals and base_run["val_bpb"] == evals[-1]["val_bpb"]
    # held-out bits per byte well below what token frequencies alone give
    assert base_run["val_bpb"] < 0.8 * base_run["unigram_bpb"], (base_run["val_bpb"], base_run["unigram_bpb"])
    train = [h["loss"] for h in base_run["history"] if h["kind"] == "train"]
    assert sum(train[-10:]) / 10 < sum(train[:10]) / 10 - 1.0


def test_run_writes_an_hf_directory_logs_and_curve(base_run, tmp_path):
    from pathlib import Path

    out = Path(base_run["out"])
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "checkpoint.pt", "metrics.jsonl", "loss_curve.png"):
        assert (out / name).is_file(), name
    assert (out / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    kinds = {json.loads(line)["kind"] for line in (out / "metrics.jsonl").read_text().splitlines()}
    assert {"setup", "train", "eval"} <= kinds
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True


def _engine_logits(model, tokenizer, ids: list[int]) -> torch.Tensor:
    """The logits the serving engine computes for every prompt position (paged KV, chunked prefill)."""
    llm = LLM(model, tokenizer=tokenizer, kv_cache_memory="16MiB", max_num_batched_tokens=16,
              kv_cache_dtype="fp32")   # the default fp16 cache moves logits by ~1e-3
    rows: list[torch.Tensor] = []
    hook = llm.engine.core.runner.model.lm_head.register_forward_hook(lambda m, i, o: rows.append(o.detach().clone()))
    try:
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                     use_tqdm=False)
    finally:
        hook.remove()
    return torch.cat(rows)


def test_engine_logits_equal_training_logits(base_run):
    trained = base_run["model"]
    lm = load_model(base_run["out"], weight_format="fp32")
    text = ("And God said, Let there be light: and there was light. And God saw the light, that it was good: "
            "and God divided the light from the darkness.")
    ids = lm.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 32           # several 16-token prefill chunks
    with torch.no_grad():
        want = trained.compute_logits(trained(torch.tensor([ids])))[0]
        loaded = lm.model.compute_logits(lm.model(torch.tensor([ids])))[0]
    assert (loaded - want).abs().max() <= 1e-4
    got = _engine_logits(lm.model, lm.tokenizer, ids)
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-4


def test_resume_reproduces_the_uninterrupted_losses(tok_dir, pretrain_config, tmp_path):
    kw = {"max_steps": 8, "batch_size": 4, "checkpoint_every": 100, "eval_every": 100, "eval_windows": 2,
          "warmup_steps": 3}
    full = pretrain(pretrain_config(tok_dir, tmp_path / "full", **kw))
    want = [h["loss"] for h in full["history"] if h["kind"] == "train"]
    first = pretrain(pretrain_config(tok_dir, tmp_path / "split", stop_after_steps=3, **kw))
    assert first["steps"] == 3
    second = pretrain(pretrain_config(tok_dir, tmp_path / "split", resume=True, **kw))
    got = [h["loss"] for h in first["history"] + second["history"] if h["kind"] == "train"]
    assert got == want          # bit-exact, not approximately
    assert torch.equal(second["model"].embed_tokens, full["model"].embed_tokens)
