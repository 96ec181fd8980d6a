"""Experiment (issue 16): does an EAGLE head that also reads low, middle and high layers' features
(EAGLE-3's idea) agree with the target more often than one that reads only the final feature?
Both heads are trained on the same generated answers for the same steps, then scored by greedy
teacher-forced top-1 agreement on the open prompts of `bench latency` (out-of-vocabulary labels
count as misses).

    PYTHONPATH=src python scripts/eagle_feature_layers.py N_PROMPTS STEPS OUTDIR

The engine's C forward does not hand out inner layers, so generation runs the layer path with
forward hooks (slower, the same numbers). Result of `1600 1200` on 2026-11-26: BENCHMARKS.md, issue 16.
"""
import json
import random
import sys
import time
from collections import Counter

import torch

from kvserve import LLM, SamplingParams
from kvserve.bench.spec_latency import OPEN_PROMPTS
from kvserve.engine.spec_decode.proposer import HiddenSink
from kvserve.model.loader import load_model
from kvserve.train.draft import EagleHead, _draft_model
from kvserve.train.draft_prompts import chat_prompts

N, STEPS, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
LAYERS = [2, 14, 26]          # residual stream after these layers (low, mid, high)
GEN = 256
torch.set_num_threads(2)
t0 = time.time()
lm = load_model(None); tok = lm.tokenizer; model = lm.model
H = model.config.hidden_size
cap = {}
hooks = [model.layers[i].register_forward_hook(lambda mod, args, out, i=i: cap.__setitem__(i, out.detach()))
         for i in LAYERS]
ops = model.layer_ops()
ops.forward_stack = lambda *a, **k: None          # the layer path: hooks see every layer's output

def gen(prompts, greedy_share, max_tokens, seed=0):
    llm = LLM(model, tokenizer=tok, kv_cache_memory="768MiB", enable_prefix_caching=False)
    kept = {}
    def sink(scheduled, hidden):
        r = 0
        allf = torch.cat([hidden] + [cap[i] for i in LAYERS], -1)
        for s in scheduled:
            req, n = s.request, s.num_new_tokens
            f = kept.get(req.request_id)
            if f is None:
                f = kept[req.request_id] = torch.zeros(req.num_prompt_tokens + max_tokens, allf.shape[-1], dtype=torch.float16)
            a = s.num_computed_tokens; b = min(a + n, f.shape[0])
            f[a:b] = allf[r:r + b - a]
            r += n
    llm.engine.core.runner.hidden_sink = HiddenSink(lambda s, h, c: sink(s, h))
    reqs = [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True)} for p in prompts]
    ng = round(greedy_share * len(reqs))
    params = [SamplingParams(temperature=0.0 if i < ng else 0.7, max_tokens=max_tokens, seed=seed + i) for i in range(len(reqs))]
    outs = llm.generate(reqs, params, use_tqdm=False)
    seqs = [list(r["prompt_token_ids"]) + list(o.outputs[0].token_ids) for r, o in zip(reqs, outs)]
    feats = [kept.pop(o.request_id)[:len(s) - 1].clone() for s, o in zip(seqs, outs)]
    return seqs, [len(r["prompt_token_ids"]) for r in reqs], feats

rng = random.Random(0)
prompts = chat_prompts(); rng.shuffle(prompts); prompts = prompts[:N]
seqs, starts, feats = gen(prompts, 0.6, GEN)
bseqs, bstarts, bfeats = gen(OPEN_PROMPTS, 1.0, 128)
print(f"generated {sum(len(s) for s in seqs)} tokens in {time.time()-t0:.0f}s", flush=True)
for h in hooks: h.remove()
counts = Counter(t for s in seqs for t in s)
keep = sorted(t for t, _ in counts.most_common(4096))
vocab = torch.tensor(keep)
remap = torch.full((model.config.vocab_size,), -100, dtype=torch.long); remap[vocab] = torch.arange(len(keep))
fp32 = load_model(None, weight_format="fp32")
head = fp32.model.embed_tokens.detach()[vocab] if fp32.model.embed_tokens is not None else fp32.model.embed(vocab)

class MultiHead(EagleHead):
    """fc over [f_final ; low ; mid ; high ; e(x)] (5H -> H) instead of [f_final ; e(x)]."""
    def __init__(self, layer_model, hidden, nf):
        super().__init__(layer_model, hidden)
        self.nf = nf
        fc = torch.nn.Linear((nf + 1) * hidden, hidden, bias=False)
        with torch.no_grad():
            fc.weight.zero_(); fc.weight[:, nf * hidden:] = torch.eye(hidden); fc.weight[:, :hidden] = 0.1 * torch.eye(hidden)
        self.fc = fc

def batch(idx, ss, fs, st, nf):
    T = max(len(ss[i]) for i in idx) - 2
    B = len(idx)
    ids = torch.zeros(B, T, dtype=torch.long); f = torch.zeros(B, T, nf * H); ft = torch.zeros(B, T, H)
    label = torch.full((B, T), -100, dtype=torch.long); mask = torch.zeros(B, T)
    for b, i in enumerate(idx):
        s, fe, p = ss[i], fs[i], st[i]
        n = len(s) - 2
        x = fe[:n, :nf * H].float()
        if nf > 1:   # each layer's residual stream RMS-normalised (their scales differ by orders)
            x = torch.cat([x[:, :H]] + [torch.nn.functional.rms_norm(x[:, k * H:(k + 1) * H], (H,)) for k in range(1, nf)], -1)
        ids[b, :n] = torch.tensor(s[1:n + 1]); f[b, :n] = x; ft[b, :n] = fe[1:n + 1, :H].float()
        lab = remap[torch.tensor(s[2:n + 2])]; lo = max(0, p - 2)
        label[b, lo:n] = lab[lo:]; mask[b, lo:n] = 1
    return ids, f, ft, label, mask

def loss_of(m, idx, ss, fs, st, nf):
    ids, f, ft, label, mask = batch(idx, ss, fs, st, nf)
    out = m(f, ids)
    logits = out @ head.T
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), label, ignore_index=-100, reduction="none")
    reg = torch.nn.functional.smooth_l1_loss(out, ft, reduction="none").mean(-1)
    loss = ((ce + reg) * mask).sum() / mask.sum()
    agree = ((logits.argmax(-1) == label).float() * mask).sum() / mask.sum()   # out-of-vocab labels count as misses
    return loss, float(agree)

res = {}
for name, nf in (("final", 1), ("multi", 1 + len(LAYERS))):
    torch.manual_seed(0); r2 = random.Random(1)
    draft = _draft_model(fp32.model, [model.config.num_hidden_layers - 1])
    m = EagleHead(draft, H) if nf == 1 else MultiHead(draft, H, nf)
    m.requires_grad_(True).train(); draft.embed_tokens.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-4, weight_decay=0.0)
    t1 = time.time()
    for step in range(STEPS):
        lr = 3e-4 * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * (1 - step / STEPS))
        for g in opt.param_groups: g["lr"] = lr
        loss, ag = loss_of(m, r2.sample(range(len(seqs)), 8), seqs, feats, starts, nf)
        opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step()
        if step % 200 == 0: print(name, step, f"loss {float(loss.detach()):.3f} agree {ag:.3f} {time.time()-t1:.0f}s", flush=True)
    m.eval()
    with torch.no_grad():
        _, bench = loss_of(m, list(range(len(bseqs))), bseqs, bfeats, bstarts, nf)
    res[name] = bench
    print(f"== {name}: bench open-prompt teacher-forced agreement {bench:.3f} ({time.time()-t1:.0f}s)", flush=True)
with open(OUT + "/result.json", "w") as fh:
    json.dump(res, fh)
