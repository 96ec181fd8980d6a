"""`python -m kvserve.engine.process SPEC`: an EngineCore in a process of its own (MPClient's peer).

SPEC is a JSON object: model, weight_format, engine_kwargs, the two ZMQ addresses to connect to
(input: the client's PUSH, output: the client's PULL) and the parent's pid. The process loads the
model, sends EngineReady (with the tokenizer, so the client does not load the model again) or
EngineFailed, then runs the core's busy loop until Shutdown, or until its parent is gone (checked
at every poll; PR_SET_PDEATHSIG would fire when the *thread* that started us ends, and the server
starts us from its model-loading thread); an orphan then also removes the parent's temp dir of
sockets, which nobody else will.
Every message is msgpack (kvserve.engine.messages); nothing is pickled.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys

import msgspec

from kvserve.engine.messages import CoreInput, EngineFailed, EngineReady, Shutdown, decode_input, encode
from kvserve.structured.grammar import available


def tokenizer_spec(tok) -> dict:
    """What rebuilds the same Tokenizer in another process."""
    return {"json": tok.hf.to_str(), "bos_token_id": tok.bos_token_id, "eos_token_ids": list(tok.eos_token_ids),
            "add_bos": tok.add_bos, "chat_template": tok.chat_template if tok.has_chat_template else None,
            "add_eos": tok.add_eos, "default_chat_template": None if tok.has_chat_template else tok.chat_template,
            "spm_exact": tok.exact_encoder.spec if tok.exact_encoder is not None else None}


def tokenizer_from_spec(spec: dict):
    from tokenizers import Tokenizer as HFTokenizer

    from kvserve.tokenizer import Tokenizer

    tok = Tokenizer(HFTokenizer.from_str(spec["json"]), bos_token_id=spec["bos_token_id"],
                    eos_token_ids=spec["eos_token_ids"], add_bos=spec["add_bos"], add_eos=spec.get("add_eos", False),
                    chat_template=spec["chat_template"])
    if spec.get("default_chat_template"):
        tok.chat_template = spec["default_chat_template"]      # has_chat_template stays False
    if spec.get("spm_exact"):
        from kvserve.tokenizer.spm_exact import SpmEncoder

        tok.exact_encoder = SpmEncoder.from_spec(spec["spm_exact"])
    return tok


def main(argv: list[str]) -> int:
    import zmq

    spec = json.loads(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C goes to the server, which shuts us down
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(spec["input"])
    push.connect(spec["output"])
    parent = spec["parent_pid"]
    try:
        from kvserve.engine.config import EngineConfig
        from kvserve.engine.core import EngineCore
        from kvserve.engine.executor import load_engine_model

        cfg = EngineConfig(weight_format=spec["weight_format"], **spec["engine_kwargs"])
        loaded = load_engine_model(spec["model"], spec["weight_format"], cfg)
        core = EngineCore(loaded.model, cfg, loaded.tokenizer.eos_token_ids, loaded.tokenizer)
        if available():
            core.grammar_backend().warm_up()
    except Exception as e:  # noqa: BLE001 - reported to the client, which raises it
        push.send(encode(EngineFailed(str(e))))
        return 1
    push.send(encode(EngineReady(
        model_name=loaded.source.name, max_model_len=core.max_model_len, block_size=core.block_size,
        vocab_size=loaded.model.config.vocab_size, kv_cache_limited=core.context_limited_by_kv,
        enable_prefix_caching=cfg.enable_prefix_caching, tokenizer=tokenizer_spec(loaded.tokenizer))))

    orphaned = False

    def poll(timeout: float) -> list[CoreInput]:
        nonlocal orphaned
        if os.getppid() != parent:
            orphaned = True
            return [Shutdown()]
        msgs: list[CoreInput] = []
        if pull.poll(int(timeout * 1000)):
            while True:
                try:
                    msgs.append(decode_input(pull.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
                except msgspec.DecodeError as e:   # not a message of ours: drop it, keep serving
                    logging.getLogger("kvserve.engine").error("dropped an undecodable message: %s", e)
        return msgs

    core.run_busy_loop(poll, lambda outs: push.send(encode(outs)))
    push.close(linger=1000 if not orphaned else 0)
    pull.close()
    ctx.term()
    sockets = os.path.dirname(spec["input"].removeprefix("ipc://"))
    if orphaned and os.path.basename(sockets).startswith("kvserve-engine-"):   # MPClient's temp dir: the server
        shutil.rmtree(sockets, ignore_errors=True)    # died without its shutdown (SIGKILL), so nobody else will
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
