"""The EAGLE head `kvserve train draft --kind eagle` trains (train/draft.py runs the stages; serving
is spec_decode/eagle.py): the module, its loss over chained draft steps, and a saved head to
continue from (`--init`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch

from kvserve.errors import InvalidRequest


class EagleHead(torch.nn.Module):
    """fc([f_j ; e(x_{j+1})]) -> one decoder layer -> norm: the draft's output at position j, which
    should be f_{j+1} and, through the head, predict x_{j+2} (spec_decode/eagle.py serves it)."""

    def __init__(self, layer_model, hidden: int, num_inner: int = 0):
        super().__init__()
        self.body = layer_model
        self.fc = torch.nn.Linear((2 + num_inner) * hidden, hidden, bias=False)
        with torch.no_grad():    # start from the token's embedding plus a little of the final feature
            self.fc.weight.zero_()
            self.fc.weight[:, (1 + num_inner) * hidden:] = torch.eye(hidden)
            self.fc.weight[:, :hidden] = 0.1 * torch.eye(hidden)

    def forward(self, feats: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([feats, self.body.embed_tokens[next_ids]], -1))
        return self.body(next_ids, inputs_embeds=x)

    def chain(self, feats: torch.Tensor, ids: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """The head's first `depth` draft steps from every position, as serving chains them:
        feats [B, T, F] the target's features at positions 0..T-1, ids [B, T + depth - 1] the tokens
        x_1.. (ids[:, i] = x_{i+1}). Returns [B, T, H] per step s = 1..depth: row j is step s's output
        at position j+s-1 (from x_{j+s}; it predicts x_{j+s+1}). Step 1 reads the true features;
        step s > 1 reads step s-1's output at row j with the inner layers of position j, and attends
        to the step-1 rows 0..j (a draft cache computed from true features) and to its own chain at
        row j (steps 2..s). Every step runs again in each pass (a mask, not a cache): the cost is
        1 + 2 + .. + depth single passes."""
        B, T, _ = feats.shape
        H = self.body.config.hidden_size
        emb = self.body.embed_tokens
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        eye = torch.eye(T, dtype=torch.bool)
        xs = [self.fc(torch.cat([feats, emb[ids[:, :T]]], -1))]
        outs: list[torch.Tensor] = []
        for s in range(1, depth + 1):
            n = len(xs)
            mask = torch.zeros(n * T, n * T, dtype=torch.bool)
            for a in range(n):
                mask[a * T:(a + 1) * T, :T] = causal
                for b in range(1, a + 1):
                    mask[a * T:(a + 1) * T, b * T:(b + 1) * T] = eye
            pos = torch.cat([torch.arange(a, a + T) for a in range(n)]).expand(B, -1)
            h = self.body(pos, positions=pos, inputs_embeds=torch.cat(xs, 1), attn_mask=mask)
            outs = list(h.split(T, 1))
            if s < depth:
                xs.append(self.fc(torch.cat([outs[-1], feats[..., H:], emb[ids[:, s:s + T]]], -1)))
        return outs


def eagle_loss(head_model: EagleHead, seqs, feats, best, head: torch.Tensor, remap: torch.Tensor, starts,
               reg_weight: float, depth: int = 1) -> tuple[torch.Tensor, float, float]:
    """Token loss at each of `depth` chained draft steps (cross-entropy on the target's top token,
    `best`: the sampled answers' own tokens are not what greedy verification accepts; kept
    vocabulary) plus the feature regression of the first, at the answers' positions; also the first
    step's top-1 agreement and the second's where the first agreed (nan at depth 1)."""
    T = max(len(s) for s in seqs) - 1 - depth
    B, H = len(seqs), head.shape[1]
    ids = torch.zeros(B, T + depth - 1, dtype=torch.long)
    f = torch.zeros(B, T, feats[0].shape[-1])     # the final feature, then any inner layers'
    ft = torch.zeros(B, T, H)
    labels = torch.full((depth, B, T), -100, dtype=torch.long)
    mask = torch.zeros(B, T)
    for b, (s, fs, top, p) in enumerate(zip(seqs, feats, best, starts)):
        n = len(s) - 1 - depth
        ids[b, :n + depth - 1] = torch.tensor(s[1:n + depth])
        f[b, :n] = fs[:n].float()
        ft[b, :n] = fs[1:n + 1, :H].float()
        lo = max(0, p - 2)
        for d in range(depth):
            labels[d, b, lo:n] = remap[torch.tensor(top[2 + d:n + 2 + d])][lo:]
        mask[b, lo:n] = 1
    outs = head_model.chain(f, ids, depth)
    logits = [o @ head.T for o in outs]
    loss = torch.nn.functional.smooth_l1_loss(outs[0], ft, reduction="none").mean(-1) * reg_weight
    for lg, lab in zip(logits, labels):
        loss = loss + torch.nn.functional.cross_entropy(lg.transpose(1, 2), lab, ignore_index=-100, reduction="none")
    loss = (loss * mask).sum() / mask.sum()
    right = [(lg.argmax(-1) == lab) & (lab >= 0) & (mask > 0) for lg, lab in zip(logits, labels)]
    valid = (labels[0] >= 0) & (mask > 0)
    agree = float(right[0].sum() / valid.sum().clamp(min=1))
    then = float((right[1] & right[0]).sum() / right[0].sum().clamp(min=1)) if depth > 1 else float("nan")
    return loss, agree, then


class SavedHead(NamedTuple):
    body: torch.nn.Module           # its decoder layer, embedding and norm, fp32
    fc: torch.Tensor
    vocab: list[int]                # the kept head rows
    feature_layers: tuple[int, ...]


def saved_head(init: str, inner: tuple[int, ...] | None, num_layers: int) -> SavedHead:
    """The EAGLE head saved in directory `init` to continue from; its feature layers must be `inner`
    if that is given."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from kvserve.engine.spec_decode.draft import DRAFT_VOCAB_FILE
    from kvserve.engine.spec_decode.eagle import EAGLE_FILE, feature_layers
    from kvserve.errors import KVServeError
    from kvserve.model.loader import load_model

    path = Path(init)
    try:
        fc = load_file(str(path / EAGLE_FILE))["fc.weight"]
        keep = json.loads((path / DRAFT_VOCAB_FILE).read_text())["token_ids"]
        layers = feature_layers(str(path), num_layers)
        body = load_model(str(path), weight_format="fp32").model
    except (SafetensorError, OSError, KeyError, ValueError, TypeError, KVServeError) as e:
        raise InvalidRequest(f"cannot continue from {path}: {getattr(e, 'message', e)}", param="init") from None
    if inner and layers != inner:
        raise InvalidRequest(f"{path} reads feature layers {list(layers)}, not {list(inner)}", param="init")
    if body.config.num_hidden_layers != 1:
        raise InvalidRequest(f"{path} is not an EAGLE head (one decoder layer)", param="init")
    return SavedHead(body, fc, keep, layers)
