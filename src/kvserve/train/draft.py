"""`kvserve train draft --target MODEL --out DIR`: distil a small draft model for speculative
decoding (`--speculative draft:DIR`) from the target, on text the target writes itself.

    1. generate  the target answers built-in chat prompts (the engine, batched; half greedily,
                 half sampled at `temperature`): the draft learns the target's own continuations
    2. teacher   the target's log-probabilities at every position of those sequences
    3. vocab     the `vocab_size` token ids the target used most: the draft's LM head keeps only
                 those rows (a full 49k x 576 head would cost more than the draft's layers)
    4. distil    a draft of a few of the target's layers (default its first and last: the
                 embedding, tied head and final norm are the target's, frozen) is trained on
                 KL(teacher || draft) over the kept vocabulary, the teacher renormalised on it,
                 on the answers' tokens (the chat template is trivially predictable, and drafts
                 are only ever asked for answers)
    5. save      a Hugging Face directory the loader reads, plus `draft_vocab.json`; the report
                 gives the draft's top-1 agreement with the target on held-out sequences (a
                 proxy for the acceptance rate of greedy drafts)

Verification keeps speculative decoding exact whatever the draft proposes: training only
decides how many drafts are accepted.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvserve.errors import InvalidRequest
from kvserve.train.common import RunLog, make_optimizer

_TOPICS = ["the ocean", "a city at night", "bread baking", "learning a language", "the moon", "chess",
           "gardening", "a rainy morning", "electric cars", "friendship", "mountains", "coffee", "music practice",
           "a lost key", "volcanoes", "libraries", "trains", "honey bees", "saving money", "the internet",
           "a first job", "winter", "photography", "recycling", "a birthday party", "the human heart",
           "time management", "dinosaurs", "a village market", "solar power", "sleep", "running a marathon",
           "the history of writing", "cooking pasta", "a job interview", "climate change", "penguins", "the desert",
           "public speaking", "a train journey", "old castles", "video games", "first aid", "kites",
           "a science fair", "tea", "the stock market", "a thunderstorm", "learning to swim", "robots in factories",
           "the Roman Empire", "a school garden", "budget travel", "owls", "the printing press", "board games",
           "a lighthouse", "healthy breakfasts", "wind turbines", "a family dinner", "spiders", "space telescopes",
           "writing a resume", "a picnic"]
_TEMPLATES = ["Tell me about {t}.", "Write a short poem about {t}.", "Explain {t} in simple words.",
              "Give three interesting facts about {t}.", "Write a short story that involves {t}.",
              "What should a beginner know about {t}?", "Describe {t} in one paragraph.",
              "List some tips related to {t}.", "Why do people care about {t}?",
              "Write a friendly email to a colleague about {t}.", "How does {t} work?",
              "What are the pros and cons of {t}?", "Write a haiku about {t}.", "Explain {t} to a child.",
              "Give me some ideas involving {t}."]


def chat_prompts() -> list[str]:
    """The built-in prompts: every template x topic (960 open chat requests)."""
    return [tpl.format(t=t) for t in _TOPICS for tpl in _TEMPLATES]


@dataclass
class DraftConfig:
    out: str
    target: str | None = None          # the target model (None: the built-in default)
    layers: str = "first,last"         # target layers copied into the draft: "first,last", "0", "0,15,29"
    vocab_size: int = 4096             # LM-head rows kept (0: the whole vocabulary)
    num_prompts: int = 320
    gen_tokens: int = 192
    temperature: float = 0.7           # sampled answers' temperature ...
    greedy_share: float = 0.5          # ... and the share of prompts answered greedily instead
    steps: int = 600
    batch_size: int = 8
    lr: float = 3e-4
    heldout: int = 8                   # sequences kept out of training for the agreement check
    seed: int = 0
    threads: int | None = 1            # PyTorch threads for the teacher and the distillation (small ops
    quiet: bool = False                # run best on one thread on a busy machine)

    def __post_init__(self) -> None:
        if self.num_prompts < self.heldout + 1:
            raise InvalidRequest("num_prompts must be larger than heldout", param="num_prompts")
        if self.steps < 0 or self.batch_size < 1 or self.gen_tokens < 1 or self.vocab_size < 0:
            raise InvalidRequest("steps, batch_size, gen_tokens and vocab_size must be positive", param="steps")


def _layer_ids(spec: str, n: int) -> list[int]:
    out = []
    for part in spec.split(","):
        part = part.strip()
        i = 0 if part == "first" else n - 1 if part == "last" else int(part) if part.lstrip("-").isdigit() else None
        if i is None or not -n <= i < n:
            raise InvalidRequest(f"bad draft layer {part!r}: use first, last or an index below {n}", param="layers")
        out.append(i % n)
    return out


def _generate(loaded, prompts: list[str], cfg: DraftConfig) -> tuple[list[list[int]], list[int]]:
    """The target's answers (prompt + answer ids) and each prompt's length: the first
    `greedy_share` of the prompts answered greedily (what greedy requests will verify), the rest
    sampled at `temperature`."""
    from kvserve import LLM, SamplingParams

    tok = loaded.tokenizer
    llm = LLM(loaded.model, tokenizer=tok, kv_cache_memory="512MiB")
    reqs = [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True)}
            for p in prompts]
    n_greedy = round(cfg.greedy_share * len(reqs))
    params = [SamplingParams(temperature=0.0 if i < n_greedy else cfg.temperature, max_tokens=cfg.gen_tokens,
                             seed=cfg.seed + i) for i in range(len(reqs))]
    outs = llm.generate(reqs, params, use_tqdm=False)
    return ([list(r["prompt_token_ids"]) + list(o.outputs[0].token_ids) for r, o in zip(reqs, outs)],
            [len(r["prompt_token_ids"]) for r in reqs])


@torch.no_grad()
def _teacher(model, seqs: list[list[int]], vocab: torch.Tensor) -> list[torch.Tensor]:
    """The target's log-probabilities over the kept vocabulary (renormalised), [T - 1, N] fp16 each."""
    out = []
    for s in seqs:
        hidden = model(torch.tensor(s[:-1])[None])[0]
        lp = model.compute_logits(hidden).float()[:, vocab].log_softmax(-1)
        out.append(lp.half())
    return out


def _draft_model(target_fp32, ids: list[int]):
    from kvserve.model.llama import LlamaForCausalLM

    sd = target_fp32.hf_state_dict()
    w = {k: v for k, v in sd.items() if not k.startswith("model.layers.")}
    for new, old in enumerate(ids):
        p = f"model.layers.{old}."
        w.update({f"model.layers.{new}." + k[len(p):]: v.clone() for k, v in sd.items() if k.startswith(p)})
    from kvserve.model.linear import WeightSource
    w = {k: WeightSource(tuple(v.shape), v) if v.dim() == 2 and k != "model.embed_tokens.weight" else v
         for k, v in w.items()}
    tc = target_fp32.config
    cfg = replace(tc, num_hidden_layers=len(ids), tie_word_embeddings=True, layer_types=[tc.layer_types[i] for i in ids],
                  name=f"{target_fp32.config.name}-draft{len(ids)}")
    return LlamaForCausalLM.from_weights(cfg, w, "fp32")


def _loss(model, seqs, teach, head: torch.Tensor, starts: list[int]) -> tuple[torch.Tensor, float]:
    """KL(teacher || draft) per answer token over the batch; also the top-1 agreement. starts: each
    sequence's prompt length (the chat template's tokens are trivially predictable, and drafts are
    only ever asked for answers)."""
    T = max(len(s) for s in seqs) - 1
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    tgt = torch.zeros(len(seqs), T, head.shape[0])
    mask = torch.zeros(len(seqs), T)
    for b, (s, t, p) in enumerate(zip(seqs, teach, starts)):
        n = len(s) - 1
        ids[b, :n] = torch.tensor(s[:-1])
        tgt[b, :n] = t.float()
        mask[b, max(0, p - 1):n] = 1
    logits = model(ids) @ head.T
    lp = logits.log_softmax(-1)
    kl = (tgt.exp() * (tgt - lp)).sum(-1)
    loss = (kl * mask).sum() / mask.sum()
    agree = ((logits.argmax(-1) == tgt.argmax(-1)).float() * mask).sum() / mask.sum()
    return loss, float(agree)


def train_draft(cfg: DraftConfig) -> dict:
    from kvserve.model.loader import load_model
    from kvserve.train.export import export_hf

    t0 = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rng = random.Random(cfg.seed)
    prompts = chat_prompts()
    rng.shuffle(prompts)
    prompts = (prompts * (1 + cfg.num_prompts // len(prompts)))[:cfg.num_prompts]
    target = load_model(cfg.target)
    seqs, starts = _generate(target, prompts, cfg)
    t_gen = time.perf_counter() - t0
    counts = Counter(t for s in seqs for t in s)
    keep = [t for t, _ in counts.most_common(cfg.vocab_size or None)] if cfg.vocab_size else list(
        range(target.config.vocab_size))
    for e in target.tokenizer.eos_token_ids:
        if e not in keep:
            keep.append(e)
    keep.sort()
    vocab = torch.tensor(keep)
    del target
    fp32 = load_model(cfg.target, weight_format="fp32")     # the teacher: dense fp32 batches run fastest
    tok = fp32.tokenizer
    teach = _teacher(fp32.model, seqs, vocab)
    t_teach = time.perf_counter() - t0 - t_gen
    draft = _draft_model(fp32.model, _layer_ids(cfg.layers, fp32.config.num_hidden_layers))
    del fp32
    draft.requires_grad_(True).train()
    draft.embed_tokens.requires_grad_(False)
    head = draft.embed_tokens.detach()[vocab]
    opt = make_optimizer(draft, cfg.lr, weight_decay=0.0)
    train_idx = list(range(cfg.heldout, len(seqs)))
    held = list(range(cfg.heldout))
    log = RunLog(Path(cfg.out), cfg.steps, enabled=not cfg.quiet, title="draft")
    log.start()

    def held_agreement() -> float:
        with torch.no_grad():
            return _loss(draft, [seqs[i] for i in held], [teach[i] for i in held], head, [starts[i] for i in held])[1]

    before = held_agreement()
    for step in range(cfg.steps):
        lr = cfg.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * (1 - step / max(1, cfg.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = rng.sample(train_idx, min(cfg.batch_size, len(train_idx)))
        loss, agree = _loss(draft, [seqs[i] for i in batch], [teach[i] for i in batch], head,
                            [starts[i] for i in batch])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in draft.parameters() if p.requires_grad], 1.0)
        opt.step()
        log.log("train", step, loss=float(loss.detach()), agreement=agree, lr=lr)
    draft.requires_grad_(False).eval()
    after = held_agreement()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    tok.hf.save(str(out / "tokenizer.json"))
    tok_cfg = {"chat_template": tok.chat_template} if tok.has_chat_template else {}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    export_hf(draft, out, out, tok.eos_token_ids)
    (out / "draft_vocab.json").write_text(json.dumps({"token_ids": keep}) + "\n")
    result = {"out": str(out), "layers": cfg.layers, "vocab_size": len(keep), "sequences": len(seqs),
              "tokens": sum(len(s) for s in seqs), "steps": cfg.steps,
              "heldout_top1_agreement_before": round(before, 4), "heldout_top1_agreement": round(after, 4),
              "generate_s": round(t_gen, 1), "teacher_s": round(t_teach, 1),
              "seconds": round(time.perf_counter() - t0, 1)}
    log.log("summary", cfg.steps, **{k: v for k, v in result.items() if isinstance(v, (int, float))})
    log.close(cfg)
    return result
