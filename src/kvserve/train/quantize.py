"""`kvserve quantize MODEL --type q8_0|q4_0|q4_1|q4_k|q6_k --out FILE.gguf [--calibrate FILE]`.

Post-training quantization of a model kvserve loads (a Hugging Face directory, a kvserve
training checkpoint, a GGUF file or a built-in name) into a GGUF file that kvserve and
llama.cpp both serve:

    source -> fp32 weights under HF names (load_source)
           -> [--calibrate: activation-aware per-channel scales, calibrate.py]
           -> block quantization + GGUF metadata/tokenizer (gguf_export.py, quant_formats.py)
           -> a summary table: bytes and held-out perplexity before and after

Perplexity is measured on the same token windows for both (the bundled held-out text unless
--eval-text), with the quantized file's weights dequantized and fp32 math, so the change is the
quantization's own (not that of the serving kernels' int8 activations).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.errors import InvalidRequest
from kvserve.model.config import ModelConfig
from kvserve.tokenizer import Tokenizer
from kvserve.train.quant_formats import TYPES


@dataclass
class QuantizeConfig:
    model: str | None
    type: str
    out: str
    calibrate: str | None = None        # calibration text file (AWQ-style scale search)
    calib_tokens: int = 4096
    eval_text: str | None = None        # held-out text file (default: the bundled held-out split)
    eval_windows: int = 8
    seq_len: int = 256
    evaluate: bool = True
    progress: bool = True


@dataclass
class Source:
    config: ModelConfig
    weights: dict[str, torch.Tensor]    # fp32, Hugging Face names
    tokenizer: Tokenizer
    reader: object | None               # the gguf.GGUFReader when the source is a GGUF file
    label: str


def load_source(model: str | None) -> Source:
    """fp32 weights of any model kvserve loads, or of a kvserve checkpoint (checkpoint.pt, or a
    directory holding one next to its tokenizer files)."""
    from kvserve.train.checkpoint import CHECKPOINT_NAME

    p = Path(model) if model else None
    ckpt = None
    if p is not None and p.is_file() and p.suffix == ".pt":
        ckpt = p
    elif p is not None and p.is_dir() and (p / CHECKPOINT_NAME).is_file() and not (p / "model.safetensors").is_file():
        ckpt = p / CHECKPOINT_NAME
    if ckpt is not None:
        return _from_checkpoint(ckpt)
    from kvserve.model.loader import load_model

    lm = load_model(model, weight_format="fp32")
    reader = None
    if lm.source.kind == "gguf":
        from kvserve.model.gguf_loader import open_gguf

        reader = open_gguf(lm.source.path)
    return Source(lm.config, lm.model.hf_state_dict(), lm.tokenizer, reader, lm.source.name)


def _from_checkpoint(path: Path) -> Source:
    from kvserve.model.decoder import DecoderLM
    from kvserve.train.checkpoint import read_checkpoint

    state = read_checkpoint(path, "model")
    if not isinstance(state, dict) or not state.get("model_config") or "model" not in state:
        raise InvalidRequest(f"{path} is not a kvserve training checkpoint (no model_config)", param="model")
    cfg = ModelConfig.from_hf_dict(state["model_config"])
    cfg.name = cfg.name or path.parent.name
    net = DecoderLM.random(cfg)
    net.load_state_dict(state["model"])
    tok_dir = path.parent
    if not (tok_dir / "tokenizer.json").is_file():
        raise InvalidRequest(f"{tok_dir} has no tokenizer.json next to the checkpoint", param="model")
    return Source(cfg, net.hf_state_dict(), Tokenizer.from_dir(tok_dir), None, path.parent.name)


def heldout_text(path: str | None) -> str:
    if path:
        return Path(path).read_text(encoding="utf-8")
    from kvserve.train.data import load_corpus, split_documents

    return "\n\n".join(split_documents(load_corpus())[1][:6])


def eval_weights(cfg: ModelConfig, weights: dict, tok: Tokenizer, text: str, seq_len: int, windows: int):
    """Held-out perplexity of fp32 weights (HF names) on the first `windows` windows of `text`."""
    from kvserve.model.decoder import DecoderLM
    from kvserve.model.linear import WeightSource
    from kvserve.train.evaluate import evaluate_stream, token_byte_lengths

    w = {k: (WeightSource(tuple(t.shape), tensor=t) if t.dim() == 2 and k != "model.embed_tokens.weight" else t)
         for k, t in weights.items()}
    with torch.no_grad():
        net = DecoderLM.from_weights(cfg, w, "fp32").eval()
    ids = torch.tensor(tok.encode(text, add_special_tokens=True), dtype=torch.long)
    seq_len = min(seq_len, cfg.max_position_embeddings - 1)
    return evaluate_stream(net, ids, token_byte_lengths(tok), seq_len, 4, windows)


def dequantized_weights(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    from kvserve.model.loader import load_model

    lm = load_model(str(path), weight_format="fp32")
    return lm.config, lm.model.hf_state_dict(), lm.tokenizer


def quantize(qc: QuantizeConfig) -> dict:
    """Run the whole pipeline; returns the summary (rows of the table and the table itself)."""
    from kvserve.train.gguf_export import check_supported, write_gguf

    qtype = qc.type.lower()
    if qtype not in TYPES:
        raise InvalidRequest(f"unknown quantization type {qc.type!r}; choose one of {', '.join(TYPES)}", param="type")
    if not qc.out.endswith(".gguf"):
        raise InvalidRequest(f"--out must name a .gguf file, got {qc.out!r}", param="out")
    if qc.calibrate and not Path(qc.calibrate).is_file():
        raise InvalidRequest(f"calibration file not found: {qc.calibrate}", param="calibrate")
    t0 = time.perf_counter()
    src = load_source(qc.model)
    check_supported(src.config)
    weights = dict(src.weights)
    rows: list[dict] = []
    if qc.calibrate:
        from kvserve.train.calibrate import awq_scale

        text = Path(qc.calibrate).read_text(encoding="utf-8")
        weights, report = awq_scale(src.config, weights, src.tokenizer, text, qtype, qc.calib_tokens, qc.progress)
    n_tensors = len([k for k in weights if not (k == "lm_head.weight" and src.config.tie_word_embeddings)])
    from kvserve.train.calibrate import Progress

    bar = Progress(n_tensors, f"quantize {qtype}", qc.progress)
    Path(qc.out).parent.mkdir(parents=True, exist_ok=True)
    try:
        counts = write_gguf(qc.out, src.config, weights, src.tokenizer, qtype, src.reader,
                            on_tensor=lambda name, t: bar.step(f"{name} {t}"))
    finally:
        bar.close()
    fp32_bytes = sum(t.numel() * 4 for k, t in src.weights.items()
                     if not (k == "lm_head.weight" and src.config.tie_word_embeddings))
    rows.append({"model": f"{src.label} (fp32)", "bytes": fp32_bytes})
    rows.append({"model": Path(qc.out).name + (" (calibrated)" if qc.calibrate else ""),
                 "bytes": Path(qc.out).stat().st_size})
    if qc.evaluate:
        text = heldout_text(qc.eval_text)
        rows[0]["result"] = eval_weights(src.config, src.weights, src.tokenizer, text, qc.seq_len, qc.eval_windows)
        cfg2, w2, tok2 = dequantized_weights(qc.out)
        rows[1]["result"] = eval_weights(cfg2, w2, tok2, text, qc.seq_len, qc.eval_windows)
    summary = {"out": qc.out, "types": counts, "seconds": round(time.perf_counter() - t0, 1),
               "rows": rows, "table": summary_table(rows)}
    if qc.calibrate:
        summary["calibration"] = report
    return summary


def summary_table(rows: list[dict]) -> str:
    out = ["| model | bytes | vs fp32 | perplexity | change |", "|---|---:|---:|---:|---:|"]
    ref_b = rows[0]["bytes"]
    ref = rows[0].get("result")
    for r in rows:
        res = r.get("result")
        ppl = f"{res.perplexity:.4f}" if res else "-"
        change = f"{100 * (res.perplexity / ref.perplexity - 1):+.2f}%" if res and ref else "-"
        out.append(f"| {r['model']} | {r['bytes']:,} | {r['bytes'] / ref_b:.3f}x | {ppl} | {change} |")
    return "\n".join(out)


def dequantize_to_hf(model: str | None, out: str | Path) -> Path:
    """Write any model kvserve loads (default: the built-in Q4_1 GGUF) as an fp32 Hugging Face
    directory: the "own fp32 weights" a re-quantization starts from."""
    import json

    from kvserve.model.loader import load_model
    from kvserve.train.export import export_hf

    lm = load_model(model, weight_format="fp32")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lm.tokenizer.hf.save(str(out / "tokenizer.json"))
    tok_cfg = {"chat_template": lm.tokenizer.chat_template} if lm.tokenizer.has_chat_template else {}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return export_hf(lm.model, out, out, lm.tokenizer.eos_token_ids)
