"""`kvserve train draft --target MODEL --out DIR`: distil a small draft model for speculative
decoding (`--speculative draft:DIR`) from the target, on text the target writes itself.

    1. generate  the target answers chat prompts (the engine, batched; half greedily, half sampled
                 at `temperature`): the draft learns the target's own continuations. The prompts are
                 built in (train/draft_prompts.py), and a `self_prompt_share` of them can be requests
                 the target writes itself, as varied as its own chat data
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

`--kind eagle` makes an EAGLE-style head instead (spec_decode/eagle.py): one decoder layer (from the
target's last) over fc([f_j ; e(x_{j+1})]), f_j the target's final hidden state at position j
(with `--feature-layers 2,14,26`, followed by those inner layers' residual streams). Its
data come from step 1 alone: the engine's hidden rows are kept as the target writes (the model
runner's hidden sink), and the label at each position is the token the target wrote there (its
argmax, for the greedy share), so there is no teacher pass. Loss: cross-entropy on that token over
the kept vocabulary plus `reg_weight` x smooth-L1 between the head's output and f_{j+1} (the next
draft step feeds its own output as the feature). With `eagle_steps` > 1 (EAGLE-3's training-time
test) the head is also run as serving chains it: step s at position j+s-1 reads its own step s-1
output, the inner layers of position j and the token x_{j+s}, attends to the positions computed from
true features up to j and to its own chain, and is scored on x_{j+s+1} (train/draft_eagle.py's
EagleHead.chain). `init` continues from a saved head (its weights, vocabulary and feature layers):
1,200 steps of this from e7 on 2,400 new prompts took the second draft, where the first was
accepted, from 0.32 to 0.50 accepted, and the first from 0.54 to 0.57 (the open prompts of
`bench latency` at k = 2; BENCHMARKS.md, issue 16).

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
from kvserve.train.draft_eagle import EagleHead, eagle_loss, saved_head
from kvserve.train.draft_prompts import chat_prompts, self_prompts


@dataclass
class DraftConfig:
    out: str
    target: str | None = None          # the target model (None: the built-in default)
    kind: str = "layers"               # "layers": a small model of the target's layers; "eagle": an
                                       # EAGLE head over the target's features (spec_decode/eagle.py)
    layers: str = "first,last"         # target layers copied into the draft: "first,last", "0", "0,15,29"
    reg_weight: float = 1.0            # eagle: weight of the feature regression beside the token loss
    feature_layers: str = ""           # eagle: inner target layers the head reads too ("2,14,26"; EAGLE-3)
    eagle_steps: int = 2               # eagle: chained draft steps trained (1: only the first, from true features)
    init: str | None = None            # eagle: start from the head saved in this directory
    vocab_size: int = 4096             # LM-head rows kept (0: the whole vocabulary)
    num_prompts: int = 320
    gen_tokens: int = 192
    temperature: float = 0.7           # sampled answers' temperature ...
    greedy_share: float = 0.5          # ... and the share of prompts answered greedily instead
    self_prompt_share: float = 0.0     # share of the prompts the target writes itself (draft_prompts.py)
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
        if self.kind not in ("layers", "eagle"):
            raise InvalidRequest(f"unknown draft kind {self.kind!r}: layers or eagle", param="kind")
        if self.feature_layers and self.kind != "eagle":
            raise InvalidRequest("feature_layers is for --kind eagle", param="feature_layers")
        if self.init and self.kind != "eagle":
            raise InvalidRequest("init is for --kind eagle", param="init")
        if not 1 <= self.eagle_steps <= 4:
            raise InvalidRequest("eagle_steps must be 1 to 4", param="eagle_steps")
        if not 0.0 <= self.self_prompt_share <= 1.0:
            raise InvalidRequest("self_prompt_share must be within 0..1", param="self_prompt_share")
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


def _generate(loaded, prompts: list[str], cfg: DraftConfig, features: bool = False,
              inner: tuple[int, ...] = ()):
    """The target's answers (prompt + answer ids) and each prompt's length: the first
    `greedy_share` of the prompts answered greedily (what greedy requests will verify), the rest
    sampled at `temperature`. features: also the target's final hidden state at every position
    but the last (followed by the `inner` layers' rows, spec_decode/eagle.py's draft_features),
    [len - 1, (1 + len(inner)) H] fp16 per sequence, kept from the engine's own steps (the model
    runner's hidden sink: the features an EAGLE draft will read when serving)."""
    from kvserve import LLM, SamplingParams
    from kvserve.engine.spec_decode.eagle import draft_features
    from kvserve.engine.spec_decode.proposer import HiddenSink

    tok = loaded.tokenizer
    llm = LLM(loaded.model, tokenizer=tok, kv_cache_memory="512MiB", enable_prefix_caching=False)
    kept: dict[str, torch.Tensor] = {}     # request id -> [prompt + gen_tokens, width] fp16, written in place
    if features:
        def sink(scheduled, hidden, captured=None):
            hidden = draft_features(hidden, captured)
            r = 0
            for s in scheduled:
                req, n = s.request, s.num_new_tokens
                f = kept.get(req.request_id)
                if f is None:
                    f = kept[req.request_id] = torch.zeros(req.num_prompt_tokens + cfg.gen_tokens,
                                                           hidden.shape[-1], dtype=torch.float16)
                a = s.num_computed_tokens
                b = min(a + n, f.shape[0])
                f[a:b] = hidden[r:r + b - a]
                r += n
        llm.engine.core.runner.hidden_sink = HiddenSink(sink, inner)
    reqs = [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True)}
            for p in prompts]
    n_greedy = round(cfg.greedy_share * len(reqs))
    # sampled answers also report the target's raw top token at each position (logprobs=1): an EAGLE
    # head learns what greedy verification accepts, the argmax, not the sampled token
    params = [SamplingParams(temperature=0.0 if i < n_greedy else cfg.temperature, max_tokens=cfg.gen_tokens,
                             seed=cfg.seed + i, logprobs=1 if features and i >= n_greedy else None)
              for i in range(len(reqs))]
    outs = llm.generate(reqs, params, use_tqdm=False)
    seqs = [list(r["prompt_token_ids"]) + list(o.outputs[0].token_ids) for r, o in zip(reqs, outs)]
    feats = [kept.pop(o.request_id)[:len(s) - 1].clone() for s, o in zip(seqs, outs)] if features else None
    best = None
    if features:
        best = [list(s) if o.outputs[0].logprobs is None else list(r["prompt_token_ids"]) + [
            min(lp, key=lambda t: lp[t].rank or 1 << 30) for lp in o.outputs[0].logprobs]
            for s, r, o in zip(seqs, reqs, outs)]
    return seqs, [len(r["prompt_token_ids"]) for r in reqs], feats, best


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
    from kvserve.model.decoder import DecoderLM

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
    return DecoderLM.from_weights(cfg, w, "fp32")


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


def _prompts(loaded, cfg: DraftConfig) -> tuple[list[str], int]:
    """cfg.num_prompts distinct prompts (so the held-out ones are unseen): built in, and a
    self_prompt_share written by the target (fewer if it writes fewer usable ones), mixed so that
    both kinds are answered greedily and sampled, and held out. Also how many the target wrote."""
    n_self = round(cfg.self_prompt_share * cfg.num_prompts)
    prompts = chat_prompts(cfg.num_prompts - n_self, cfg.seed)
    prompts = (prompts * (1 + (cfg.num_prompts - n_self) // max(1, len(prompts))))[:cfg.num_prompts - n_self]
    if not n_self:
        return prompts, 0
    from kvserve import LLM

    llm = LLM(loaded.model, tokenizer=loaded.tokenizer, kv_cache_memory="512MiB")
    own = self_prompts(llm, loaded.tokenizer, n_self, cfg.seed)
    del llm
    prompts += own
    random.Random(cfg.seed + 1).shuffle(prompts)
    return prompts, len(own)


def train_draft(cfg: DraftConfig) -> dict:
    from kvserve.engine.spec_decode.draft import DRAFT_VOCAB_FILE
    from kvserve.model.loader import load_model
    from kvserve.train.export import export_hf

    t0 = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rng = random.Random(cfg.seed)
    target = load_model(cfg.target)
    prompts, n_own = _prompts(target, cfg)
    inner = tuple(_layer_ids(cfg.feature_layers, target.config.num_hidden_layers)) if cfg.feature_layers else ()
    if len(set(inner)) != len(inner):
        raise InvalidRequest(f"feature layers repeat: {cfg.feature_layers!r}", param="feature_layers")
    start = None                  # a saved head to continue from: its feature layers and vocabulary
    if cfg.init:
        start = saved_head(cfg.init, inner if cfg.feature_layers else None, target.config.num_hidden_layers)
        inner = start.feature_layers
    seqs, starts, feats, best = _generate(target, prompts, cfg, features=cfg.kind == "eagle", inner=inner)
    t_gen = time.perf_counter() - t0
    counts = Counter(t for s in (best or seqs) for t in s)     # the tokens a draft is trained to propose
    keep = [t for t, _ in counts.most_common(cfg.vocab_size or None)] if cfg.vocab_size else list(
        range(target.config.vocab_size))
    if start is not None:        # the saved head's rows
        keep = list(start.vocab)
    for e in target.tokenizer.eos_token_ids:
        if e not in keep:
            keep.append(e)
    keep.sort()
    vocab = torch.tensor(keep)
    del target
    fp32 = load_model(cfg.target, weight_format="fp32")     # the layers to copy, and the teacher (not for
                                                             # eagle): dense fp32 batches run fastest
    tok = fp32.tokenizer
    layer_ids = _layer_ids("last" if cfg.kind == "eagle" and cfg.layers == "first,last" else cfg.layers,
                           fp32.config.num_hidden_layers)
    if cfg.kind == "eagle":    # hard labels and features from the generation itself: no teacher pass
        teach = None
        layer_ids = layer_ids[:1]
        draft = _draft_model(fp32.model, layer_ids) if start is None else start.body
        model = EagleHead(draft, fp32.config.hidden_size, len(inner))
        if start is not None:
            with torch.no_grad():
                model.fc.weight.copy_(start.fc)
        remap = torch.full((fp32.config.vocab_size,), -100, dtype=torch.long)
        remap[vocab] = torch.arange(len(keep))
    else:
        teach = _teacher(fp32.model, seqs, vocab)
        draft = _draft_model(fp32.model, layer_ids)
        model = draft
    t_teach = time.perf_counter() - t0 - t_gen
    del fp32
    model.requires_grad_(True).train()
    draft.embed_tokens.requires_grad_(False)
    head = draft.embed_tokens.detach()[vocab]
    opt = make_optimizer(model, cfg.lr, weight_decay=0.0)
    train_idx = list(range(cfg.heldout, len(seqs)))
    held = list(range(cfg.heldout))
    log = RunLog(Path(cfg.out), cfg.steps, enabled=not cfg.quiet, title="draft")
    log.start()

    chained = cfg.kind == "eagle" and cfg.eagle_steps > 1

    def loss_of(idx: list[int]) -> tuple[torch.Tensor, float, float]:
        if cfg.kind == "eagle":
            return eagle_loss(model, [seqs[i] for i in idx], [feats[i] for i in idx], [best[i] for i in idx],
                              head, remap, [starts[i] for i in idx], cfg.reg_weight, cfg.eagle_steps)
        return *_loss(draft, [seqs[i] for i in idx], [teach[i] for i in idx], head, [starts[i] for i in idx]), \
            float("nan")

    def held_agreement() -> tuple[float, float]:
        with torch.no_grad():
            return loss_of(held)[1:]

    before, before2 = held_agreement()
    for step in range(cfg.steps):
        lr = cfg.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * (1 - step / max(1, cfg.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, agree, then = loss_of(rng.sample(train_idx, min(cfg.batch_size, len(train_idx))))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        log.log("train", step, loss=float(loss.detach()), agreement=agree, lr=lr,
                **({"step2_agreement": then} if chained else {}))
    model.requires_grad_(False).eval()
    after, after2 = held_agreement()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    tok.hf.save(str(out / "tokenizer.json"))
    tok_cfg = {"chat_template": tok.chat_template} if tok.has_chat_template else {}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    export_hf(draft, out, out, tok.eos_token_ids)
    (out / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": keep}) + "\n")
    if cfg.kind == "eagle":
        from safetensors.torch import save_file

        from kvserve.engine.spec_decode.eagle import EAGLE_CONFIG, EAGLE_FILE
        save_file({"fc.weight": model.fc.weight.detach().contiguous()}, str(out / EAGLE_FILE))
        (out / EAGLE_CONFIG).write_text(json.dumps({"feature_layers": list(inner)}) + "\n")
    result = {"out": str(out), "kind": cfg.kind, "layers": layer_ids, "feature_layers": list(inner), "vocab_size": len(keep), "sequences": len(seqs),
              "self_prompts": n_own,
              "tokens": sum(len(s) for s in seqs), "steps": cfg.steps,
              "heldout_top1_agreement_before": round(before, 4), "heldout_top1_agreement": round(after, 4),
              **({"heldout_step2_agreement_before": round(before2, 4), "heldout_step2_agreement": round(after2, 4)}
                 if chained else {}),
              "init": cfg.init,
              "generate_s": round(t_gen, 1), "teacher_s": round(t_teach, 1),
              "seconds": round(time.perf_counter() - t0, 1)}
    log.log("summary", cfg.steps, **{k: v for k, v in result.items() if isinstance(v, (int, float))})
    log.close(cfg)
    return result
