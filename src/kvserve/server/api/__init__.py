"""The public APIs, one module each: its routes, its body → a chat or completions request, and its
renderer over the one generation path (server/generation/). A new API (Anthropic Messages,
Ollama's) is a new module here.

    openai.py + openai_wire.py   /v1/chat/completions, /v1/completions
    responses.py + responses_wire.py   /v1/responses
    arena.py                     /v1/kvserve/arena (the chat stream, contestants anonymous)
"""
