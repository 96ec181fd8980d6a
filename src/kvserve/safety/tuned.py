"""The moderation encoder's tuned top layers (safety/finetune.py trains them), as served.

`TopLayers` runs MiniLM-shaped layers on the hidden states after the shared encoder's first
`start` layers, mean-pools and L2-normalizes them: the vector moderation's head (head.py) judges.
The weights ship in safety/data/head.npz beside the head (arrays `top.*`, fp16).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.bert import BertConfig, BertLayer

PREFIX = "top."


class TopLayers(nn.Module):
    def __init__(self, config: BertConfig, start: int, hidden: int = 64, outputs: int = 10, layers: int | None = None):
        super().__init__()
        self.start = start
        n = config.num_hidden_layers - start if layers is None else layers
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(n))
        self.head = nn.Sequential(nn.Linear(config.hidden_size, hidden), nn.ReLU(), nn.Linear(hidden, outputs))

    def embed(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, T, H] hidden states after `start` layers and their 0/1 mask -> [B, H] unit vectors."""
        bias = torch.zeros(mask.shape, dtype=x.dtype).masked_fill(mask == 0, -torch.inf)[:, None, None, :]
        for layer in self.layers:
            x = layer(x, bias)
        m = mask[..., None].to(x.dtype)
        return F.normalize((x * m).sum(1) / m.sum(1).clamp(min=1e-9), p=2, dim=1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x, mask))

    def arrays(self) -> dict[str, np.ndarray]:
        """The layers' weights to ship (fp16) and where they start."""
        out = {PREFIX + k: v.detach().numpy().astype(np.float16) for k, v in self.layers.state_dict().items()}
        out[PREFIX + "start"] = np.array(self.start)
        return out


def from_arrays(arrays: dict[str, np.ndarray], config: BertConfig) -> TopLayers | None:
    """The tuned layers stored in a head file (None when it has none), fp32 for serving."""
    if PREFIX + "start" not in arrays:
        return None
    sd = {k[len(PREFIX):]: torch.from_numpy(v.astype(np.float32)) for k, v in arrays.items()
          if k.startswith(PREFIX) and k != PREFIX + "start"}
    n = 1 + max(int(k.split(".")[0]) for k in sd)
    m = TopLayers(config, int(arrays[PREFIX + "start"]), layers=n)
    m.layers.load_state_dict(sd)
    return m.eval()


BRANCH = "moderation"


def attach(encoder, head) -> str | None:
    """The depth to ask `encoder.encode_depths` for `head`'s vectors: BRANCH, the head's tuned layers
    registered on the encoder once (they run on the same forward's states after layer `start`), or
    None (the full embedding) when the head has no tuned layers."""
    if not getattr(head, "top", None):
        return None
    branch = encoder.branches.get(BRANCH)
    if branch is None or getattr(branch, "owner", None) is not head.top:     # another head's layers
        branch = from_arrays(head.top, encoder.model.config)
        branch.owner = head.top
        encoder.branches[BRANCH] = branch
    return BRANCH
