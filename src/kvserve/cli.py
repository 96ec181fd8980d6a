"""The `kvserve` command: run | chat | models | serve | keys | bench | train | eval."""

from __future__ import annotations

import importlib.util
import sys

import typer

from kvserve.engine.spec_decode.config import NUM_SPEC_HELP, SPECULATIVE_HELP
from kvserve.errors import KVServeError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="kvserve: an LLM serving system. `kvserve run \"question\"` to try it.")

MODEL_HELP = "Model: a built-in name (see `kvserve models`), a .gguf file or a Hugging Face directory."


def _fail(e: KVServeError) -> None:
    typer.echo(f"error: {e.message}", err=True)
    raise typer.Exit(1)


def _load_llm(model: str | None, weight_format: str, max_model_len: int | None = None,
              speculative: str | None = None, num_speculative_tokens: int | None = None):
    from rich.console import Console

    from kvserve.engine.llm import LLM
    from kvserve.engine.spec_decode.config import SpeculativeConfig

    SpeculativeConfig.parse(speculative, num_speculative_tokens)      # a bad option fails before loading
    with Console(stderr=True).status(f"Loading {model or 'the default model'}..."):
        return LLM(model, weight_format=weight_format, kv_cache_memory="256MiB", max_model_len=max_model_len,
                   speculative=speculative, num_speculative_tokens=num_speculative_tokens)


def _stream(llm, prompt_ids: list[int], params, stats: bool = False) -> str:
    """Generate and print the answer as it comes; Ctrl-C stops the answer (the request is aborted).
    With `stats`, a line of counts and speed follows on stderr."""
    text = []
    last = None
    outputs = llm.stream({"prompt_token_ids": prompt_ids}, params)
    try:
        for out in outputs:
            last = out
            delta = out.outputs[0].text_delta
            if delta:
                sys.stdout.write(delta)
                sys.stdout.flush()
                text.append(delta)
    except KeyboardInterrupt:
        outputs.close()                 # aborts the request
        last = llm.last_aborted or last
        sys.stdout.write(" [stopped]")
    sys.stdout.write("\n")
    sys.stdout.flush()
    if stats and last is not None and last.metrics is not None:
        m = last.metrics
        n_out = len(last.outputs[0].token_ids) if last.outputs else 0
        decode_s = (m.last_token_time or 0) - (m.first_token_time or 0)
        tps = f", {(n_out - 1) / decode_s:.1f} tokens/s" if n_out > 1 and decode_s > 0 else ""
        ttft = (m.first_token_time - m.arrival_time) * 1000 if m.first_token_time else 0.0
        typer.echo(f"[prompt {len(prompt_ids)} tokens ({last.num_cached_tokens} cached), "
                   f"{n_out} generated, first token {ttft:.0f} ms{tps}]", err=True)
    return "".join(text)


def _params(temperature: float, top_p: float, max_tokens: int, seed: int | None):
    from kvserve.sampling_params import SamplingParams

    return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)


@app.command()
def run(
    prompt: str = typer.Argument(..., help="The question (or text, with --raw); '-' reads standard input."),
    model: str = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    temperature: float = typer.Option(0.7, help="0 means greedy."),
    top_p: float = typer.Option(0.9, "--top-p"),
    max_tokens: int = typer.Option(256, "--max-tokens"),
    seed: int = typer.Option(None, help="Seed for reproducible sampling."),
    system: str = typer.Option(None, help="System prompt."),
    raw: bool = typer.Option(False, help="Continue the text as is, without the chat template."),
    weight_format: str = typer.Option("auto", help="auto | fp32 | bf16 | fp16 | gguf | q8_0 | q4_1"),
    stats: bool = typer.Option(False, help="Print token counts and speed after the answer."),
    speculative: str = typer.Option(None, "--speculative", help=SPECULATIVE_HELP),
    num_speculative_tokens: int = typer.Option(None, "--num-speculative-tokens", help=NUM_SPEC_HELP),
) -> None:
    """Answer one prompt, streaming the answer to the terminal."""
    if prompt == "-":
        prompt = sys.stdin.read()
    try:
        params = _params(temperature, top_p, max_tokens, seed)
        llm = _load_llm(model, weight_format, speculative=speculative, num_speculative_tokens=num_speculative_tokens)
        tok = llm.get_tokenizer()
        if raw:
            ids = tok.encode(prompt)
        else:
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            ids = tok.apply_chat_template(msgs, tokenize=True)
        _stream(llm, ids, params, stats)
    except KVServeError as e:
        _fail(e)


@app.command()
def chat(
    model: str = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    temperature: float = typer.Option(0.7),
    top_p: float = typer.Option(0.9, "--top-p"),
    max_tokens: int = typer.Option(512, "--max-tokens"),
    system: str = typer.Option(None, help="System prompt."),
    weight_format: str = typer.Option("auto", help="auto | fp32 | bf16 | fp16 | gguf | q8_0 | q4_1"),
    stats: bool = typer.Option(False, help="Print token counts and speed after each answer."),
) -> None:
    """Multi-turn chat in the terminal. /reset, /system TEXT, /exit; Ctrl-C stops an answer."""
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass
    try:
        params = _params(temperature, top_p, max_tokens, None)
        llm = _load_llm(model, weight_format)
    except KVServeError as e:
        _fail(e)
    tok = llm.get_tokenizer()
    history: list[dict] = []
    typer.echo(f"kvserve chat with {llm.engine.model_name}. /reset clears, /system TEXT sets the system prompt, "
               "/exit quits; Ctrl-C stops an answer.", err=True)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            typer.echo("")
            return
        except KeyboardInterrupt:
            typer.echo("")
            continue
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit", "/bye"):
            return
        if cmd == "/reset":
            history.clear()
            typer.echo("(conversation cleared)", err=True)
            continue
        if cmd.startswith("/system"):
            system = cmd[len("/system"):].strip() or None
            typer.echo(f"(system prompt {'set' if system else 'cleared'})", err=True)
            continue
        history.append({"role": "user", "content": line})
        try:
            ids = _fit(tok, system, history, llm.engine.max_model_len, max_tokens)
            answer = _stream(llm, ids, params, stats)
        except KVServeError as e:
            history.pop()
            typer.echo(f"error: {e.message}", err=True)
            continue
        history.append({"role": "assistant", "content": answer})


def _fit(tok, system: str | None, history: list[dict], max_model_len: int, max_tokens: int) -> list[int]:
    """The conversation as the server builds one (server/context.py: system prompt + history, the
    oldest turns dropped to fit, from `history` too)."""
    from kvserve.server.generation.context import conversation, fit_messages

    messages, _ = conversation(system, history, [])
    prompt = fit_messages(tok, messages, max_model_len=max_model_len, max_tokens=max_tokens, truncate="oldest")
    del history[:prompt.dropped_messages]
    return prompt.token_ids


@app.command()
def models() -> None:
    """List the models kvserve can load and where they come from."""
    from rich.console import Console
    from rich.table import Table

    from kvserve.model.registry import list_models

    t = Table(title="Built-in models")
    t.add_column("name", no_wrap=True)
    t.add_column("installed", no_wrap=True)
    t.add_column("where it comes from")
    rows = list_models()
    for m in rows:
        t.add_row(m["name"], "yes" if m["installed"] else "no", m["origin"])
    c = Console()
    c.print(t)
    for m in rows:
        if m["path"]:
            c.print(f"{m['name']}: {m['path']}", soft_wrap=True)
    c.print("Also accepted by --model: any .gguf file (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, "
            "Q5_K, Q6_K; Llama, Mistral, Qwen2 architectures) and any Hugging Face model directory "
            "(config.json, *.safetensors, tokenizer.json).")


def _mount() -> None:
    from kvserve.server.cli import keys_app, serve

    app.command(help="Serve the OpenAI-compatible API and the web chat page.")(serve)
    app.add_typer(keys_app, name="keys")
    if importlib.util.find_spec("kvserve.train.quantize_cli") is not None:
        from kvserve.train.quantize_cli import quantize_cmd

        app.command("quantize")(quantize_cmd)
    # Sub-apps whose modules may be absent in a partial install.
    for module, attr, name in (("kvserve.bench.cli", "app", "bench"), ("kvserve.train.cli", "train_app", "train"),
                               ("kvserve.train.cli", "eval_app", "eval"),
                               ("kvserve.data.cli", "data_app", "data")):
        if importlib.util.find_spec(module) is not None:
            app.add_typer(getattr(importlib.import_module(module), attr), name=name)
    if importlib.util.find_spec("kvserve.train.cli") is not None:   # `kvserve eval moderation FILE.jsonl`
        from kvserve.safety.eval_cli import moderation_cmd, train_moderation_cmd

        importlib.import_module("kvserve.train.cli").eval_app.command("moderation")(moderation_cmd)
        importlib.import_module("kvserve.train.cli").train_app.command("moderation")(train_moderation_cmd)


_mount()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
