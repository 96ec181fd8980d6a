"""Who may hit whose prefix-cache blocks: the salt the server puts on every engine request.

A prefix-cache hit is observable (`usage.prompt_tokens_details.cached_tokens`, the trace, and
the time to first token), so a shared cache lets one caller test guesses about another's
prompt block by block. The server therefore salts every request's block hashes with its scope:

    key     (default) the API key's name: a key only ever hits blocks its own requests computed
    tier    the key's tier ("paid" / "free"): keys of one tier share
    global  no salt: every caller shares (a single-tenant server; the most reuse)

Operator-declared shared prompts (`--shared-prompt`, e.g. a public system prompt every client
sends) stay shared in every scope: the blocks of a prompt that lie wholly inside its longest
common prefix with a declared prompt are hashed without the salt (`cache_salt_from`). Those
tokens are the operator's public text, so a hit on them reveals nothing. A client's own
`cache_salt` is added to the scope's and opts the request out of the shared prefixes too.
With auth off there are no keys: every caller is the same anonymous owner.
"""

from __future__ import annotations

from kvserve.server.stores.keys import ApiKey

SCOPES = ("key", "tier", "global")


class CacheScope:
    def __init__(self, scope: str = "key", shared_prompts: list[str] | tuple[str, ...] = ()):
        if scope not in SCOPES:
            raise ValueError(f"prefix cache scope must be one of {', '.join(SCOPES)}, got {scope!r}")
        self.scope = scope
        self.shared_prompts = [p for p in shared_prompts if p]
        self._shared_ids: list[list[int]] | None = None

    def salt(self, key: ApiKey | None, client_salt: str | None) -> str | None:
        """The salt for a request by `key` (None when auth is off)."""
        if self.scope == "key":
            mine = f"key:{key.name}" if key is not None else "key:"
        elif self.scope == "tier":
            mine = f"tier:{key.tier}" if key is not None else "tier:"
        else:
            mine = ""
        if client_salt:
            mine += "\x00client:" + client_salt
        return mine or None

    def _sequences(self, tokenizer) -> list[list[int]]:
        """Each declared prompt as the token ids it starts a prompt with: rendered as a chat's
        system message and as plain text."""
        if self._shared_ids is None:
            seqs = []
            for text in self.shared_prompts:
                seqs.append(tokenizer.encode(text))
                rendered = tokenizer.apply_chat_template([{"role": "system", "content": text}],
                                                         add_generation_prompt=False)
                seqs.append(tokenizer.encode(rendered, add_special_tokens=False))
            self._shared_ids = seqs
        return self._shared_ids

    def shared_prefix(self, tokenizer, token_ids: list[int], client_salt: str | None) -> int:
        """How many leading tokens of `token_ids` are a declared shared prompt's (0 with a
        client salt: that request asked for its own cache)."""
        if not self.shared_prompts or client_salt:
            return 0
        best = 0
        for seq in self._sequences(tokenizer):
            n = 0
            for a, b in zip(seq, token_ids):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best
