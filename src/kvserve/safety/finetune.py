"""The moderation encoder's top layers fine-tuned with the head (`kvserve train moderation --tune-top`).

A head on the frozen sentence embedding missed the per-source targets (docs/safety.md), so the
encoder's top TUNED layers are trained together with the head: all-MiniLM-L6-v2's first
FROZEN layers stay as shipped (their output, the hidden states after layer FROZEN, is the same
tensor the shared forward of a request passes through), and a copy of the last layers, initialized
from MiniLM's own, is tuned for moderation. The semantic cache and the router keep the untuned
embedding; moderation pools the tuned layers' output instead (model/bert.py runs them as one more
"depth" of the one forward a request pays for).

Training on 2 cores: the frozen layers' hidden states are computed once per text and cached in
DIR/.layer{FROZEN}.pt (keyed by text; ~10 minutes for the ~20,000 texts and windows, 350 MB), then
only the top layers and the head run, for EPOCHS passes in length-bucketed batches of BATCH
(about 20 minutes per pass on a busy machine), with AdamW, a fixed seed and a fixed thread count
(the same data gives the same weights on one machine).
"""

from __future__ import annotations

import hashlib
import pathlib
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

FROZEN = 4            # layers kept as shipped; the ones above are tuned
EPOCHS = 1
BATCH = 32
LR_LAYERS = 2e-5
LR_HEAD = 1e-4
SEED = 0
MAX_TOKENS = 256


def _key(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def frozen_states(texts: list[str], cache: pathlib.Path | None = None) -> dict[str, torch.Tensor]:
    """{sha1(text): [T, 384] fp16 hidden states after FROZEN layers} for every text (cached)."""
    import torch

    from kvserve.model.bert import default_encoder

    known: dict[str, torch.Tensor] = torch.load(cache) if cache is not None and cache.exists() else {}
    missing = sorted({t for t in texts if _key(t) not in known}, key=len)
    if missing:
        enc = default_encoder()
        with torch.inference_mode():
            for i in range(0, len(missing), 64):
                part = missing[i:i + 64]
                ids, mask = _batch(enc, part)
                h = enc.model.hidden_states(ids, mask, (FROZEN,))[FROZEN]
                for j, t in enumerate(part):
                    known[_key(t)] = h[j, :int(mask[j].sum())].to(torch.float16).clone()
        if cache is not None:
            torch.save(known, cache)
    return {_key(t): known[_key(t)] for t in texts}


def _batch(enc, texts: list[str]):
    import torch

    rows = []
    for e in enc.tokenizer.encode_batch(texts):
        ids = e.ids if len(e.ids) <= MAX_TOKENS else e.ids[:MAX_TOKENS - 1] + e.ids[-1:]
        rows.append(ids)
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for j, r in enumerate(rows):
        ids[j, :len(r)] = torch.tensor(r)
        mask[j, :len(r)] = 1
    return ids, mask


def pad(states: list[torch.Tensor]):
    """([B, T, H] float32, [B, T] 0/1 mask) of variable-length states."""
    import torch

    longest = max(s.shape[0] for s in states)
    x = torch.zeros(len(states), longest, states[0].shape[1])
    mask = torch.zeros(len(states), longest, dtype=torch.long)
    for j, s in enumerate(states):
        x[j, :s.shape[0]] = s.float()
        mask[j, :s.shape[0]] = 1
    return x, mask


def top_model(hidden: int, outputs: int):
    """TopLayers initialized from the shipped encoder's last layers, with a fresh head."""
    import copy

    import torch

    from kvserve.model.bert import default_encoder
    from kvserve.safety.tuned import TopLayers

    enc = default_encoder()
    torch.manual_seed(SEED)
    m = TopLayers(enc.model.config, FROZEN, hidden, outputs)
    for i, layer in enumerate(m.layers):
        layer.load_state_dict(copy.deepcopy(enc.model.layers[FROZEN + i].state_dict()))
    return m


def fit(states: list, y: np.ndarray, mask: np.ndarray, hidden: int, epochs: int = EPOCHS,
        row_weights: np.ndarray | None = None, log=None, init=None):
    """The tuned model after `epochs` passes of weighted BCE (a category's positives weigh its
    negatives in total, capped at 20x, as train_head.fit_mlp). `init`: a head.Head fitted on the
    frozen embedding to start from (the tuned layers start as MiniLM's, so training starts at that
    head's quality instead of from a random head)."""
    import torch

    torch.manual_seed(SEED)
    model = top_model(hidden, y.shape[1])
    if init is not None:
        with torch.no_grad():
            for lin, w, b in ((model.head[0], init.w1, init.b1), (model.head[2], init.w2, init.b2)):
                lin.weight.copy_(torch.from_numpy(np.asarray(w, np.float32)))
                lin.bias.copy_(torch.from_numpy(np.asarray(b, np.float32)))
    n = len(states)
    pos = y.sum(0)
    wpos = torch.tensor(np.minimum((n - pos) / np.maximum(pos, 1), 20.0), dtype=torch.float32)
    yt, mt = torch.tensor(y), torch.tensor(mask)
    rw = torch.ones(n) if row_weights is None else torch.tensor(row_weights, dtype=torch.float32)
    opt = torch.optim.AdamW([{"params": model.layers.parameters(), "lr": LR_LAYERS},
                             {"params": model.head.parameters(), "lr": LR_HEAD}], weight_decay=1e-2)
    order = sorted(range(n), key=lambda i: states[i].shape[0])
    batches = [order[i:i + BATCH] for i in range(0, n, BATCH)]
    rng = np.random.default_rng(SEED)
    steps = epochs * len(batches)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(0.0, 1 - s / steps))
    model.train()
    for ep in range(epochs):
        total = 0.0
        for bi in rng.permutation(len(batches)):
            idx = batches[bi]
            x, m = pad([states[i] for i in idx])
            logits = model(x, m)
            t = yt[idx]
            w = torch.where(t > 0, wpos, torch.ones_like(t)) * mt[idx] * rw[idx, None]
            loss = (torch.nn.functional.binary_cross_entropy_with_logits(logits, t, reduction="none") * w).sum() / len(idx)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach())
        if log:
            log(f"epoch {ep + 1}: loss {total / len(batches):.4f}")
    return model.eval()


def probs(model, states: list, batch: int = 64) -> np.ndarray:
    import torch

    out = np.zeros((len(states), model.head[-1].out_features), np.float32)
    order = sorted(range(len(states)), key=lambda i: states[i].shape[0])
    with torch.inference_mode():
        for i in range(0, len(order), batch):
            idx = order[i:i + batch]
            x, m = pad([states[j] for j in idx])
            out[idx] = torch.sigmoid(model(x, m)).numpy()
    return out


def row_probs(model, wins: list[list[str]], states: dict) -> np.ndarray:
    """Per row, each output's largest probability over its windows."""
    flat = [states[_key(w)] for ws in wins for w in ws]
    p = probs(model, flat)
    out, i = [], 0
    for ws in wins:
        out.append(p[i:i + len(ws)].max(0))
        i += len(ws)
    return np.stack(out)


def train(data_dir: pathlib.Path, out: pathlib.Path | None = None, hidden: int = 64, epochs: int = EPOCHS,
          log=None, init: pathlib.Path | None = None) -> dict:
    """Rebuild head.npz with tuned top layers: fit on `train` rows (their first 800 characters),
    starting from the head fitted on the frozen embedding (train_head.train, written to `init`
    first when not given), thresholds on `val` rows judged over their windows (never `test`)."""
    import torch

    from kvserve.safety import head as head_mod
    from kvserve.safety.datasets import OUTPUTS, load
    from kvserve.safety.train_head import _mask, _targets, pick_thresholds

    torch.set_num_threads(2)        # a fixed thread count: the same sums in the same order
    if init is None:
        from kvserve.safety import train_head

        init = pathlib.Path(data_dir) / ".head_frozen.npz"
        train_head.train(data_dir, init)
    rows = load(data_dir)
    tr = [r for r in rows if r.split == "train"]
    va = [r for r in rows if r.split == "val"]
    te = [r for r in rows if r.split == "test"]
    trt = [head_mod.train_text(r.text) for r in tr]
    vaw = [head_mod.windows(r.text) for r in va]
    tew = [head_mod.windows(r.text) for r in te]       # cached here too, for `kvserve eval moderation`
    states = frozen_states(trt + [w for ws in vaw + tew for w in ws], pathlib.Path(data_dir) / f".layer{FROZEN}.pt")
    start = head_mod.load(init)
    if start.w1 is not None:        # the frozen fit's width (train_head averages SEEDS fits: 64 units each)
        hidden = start.w1.shape[0]
    model = fit([states[_key(t)] for t in trt], _targets(tr), _mask(tr), hidden, epochs, log=log, init=start)
    thresholds = pick_thresholds(row_probs(model, vaw, states), _targets(va), np.array([not r.harmful for r in va]))
    lin1, lin2 = model.head[0], model.head[2]
    path = out or head_mod.HEAD_PATH
    head_mod.save(path, w1=lin1.weight.detach().numpy(), b1=lin1.bias.detach().numpy(),
                  w2=lin2.weight.detach().numpy(), b2=lin2.bias.detach().numpy(), thresholds=thresholds,
                  top=model.arrays())
    return {"path": str(path), "rows": len(rows), "train": len(tr), "val": len(va), "epochs": epochs,
            "tuned_layers": len(model.layers), "bytes": path.stat().st_size,
            "thresholds": dict(zip(OUTPUTS, thresholds))}


def tuned_vectors(texts: list[str], head, data_dir: pathlib.Path) -> np.ndarray:
    """[n, 384] the vectors `head`'s tuned layers give `texts` (frozen states cached in DIR)."""
    import torch

    from kvserve.model.bert import default_encoder
    from kvserve.safety.tuned import from_arrays

    top = from_arrays(head.top, default_encoder().model.config)
    states = frozen_states(texts, pathlib.Path(data_dir) / f".layer{FROZEN}.pt")
    out = np.zeros((len(texts), 384), np.float32)
    order = sorted(range(len(texts)), key=lambda i: states[_key(texts[i])].shape[0])
    with torch.inference_mode():
        for i in range(0, len(order), 64):
            idx = order[i:i + 64]
            x, m = pad([states[_key(texts[j])] for j in idx])
            out[idx] = top.embed(x, m).numpy()
    return out
