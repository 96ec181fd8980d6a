"""Write a trained model as a Hugging Face-format directory that kvserve (and transformers) load.

    out/
      config.json               ModelConfig.to_hf_dict() (LlamaForCausalLM, tied embeddings)
      model.safetensors         fp32 weights under HF names (q/k/v and gate/up split again)
      tokenizer.json            copied from the tokenizer directory
      tokenizer_config.json     with the ChatML chat_template
      generation_config.json    eos ids, so generation stops at <|im_end|> / <|endoftext|>
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from kvserve.model.decoder import DecoderLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def export_hf(model: DecoderLM, tokenizer_dir: str | Path, out_dir: str | Path,
              eos_token_ids: list[int] | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_hf_dict()
    if eos_token_ids:
        cfg["eos_token_id"] = eos_token_ids[0] if len(eos_token_ids) == 1 else list(eos_token_ids)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    # hf_state_dict's split q/k/v are views of one fused tensor: clone so safetensors sees no sharing
    weights = {k: t.detach().clone().contiguous() for k, t in model.hf_state_dict().items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    src = Path(tokenizer_dir)
    if src.resolve() != out.resolve():
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, out / name)
    gen = {"eos_token_id": cfg.get("eos_token_id"), "bos_token_id": cfg.get("bos_token_id")}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out
