"""Draft-model proposer (`--speculative draft:PATH`): a small model sharing the target's tokenizer.

Checked at startup: the path must load as a model, and its tokenizer must be the target's (same
vocabulary, same ids), else drafts would be other tokens than the target scores. Running a second
model in the runner is not built yet: a draft that passes the checks is refused with that message.
"""

from __future__ import annotations

from kvserve.errors import InvalidRequest


def same_tokenizer(a, b) -> bool:
    """Same vocabulary with the same ids (and the same end-of-sequence tokens)."""
    va = a.hf.get_vocab(with_added_tokens=True) if hasattr(a, "hf") else None
    vb = b.hf.get_vocab(with_added_tokens=True) if hasattr(b, "hf") else None
    return va == vb and list(a.eos_token_ids) == list(b.eos_token_ids)


class DraftProposer:
    @classmethod
    def load(cls, config, target_model, target_tokenizer) -> DraftProposer:
        from kvserve.model.loader import load_model
        try:
            draft = load_model(config.draft_path)
        except Exception as e:  # noqa: BLE001 - any load failure is the user's path
            raise InvalidRequest(f"cannot load the draft model {config.draft_path!r}: {e}",
                                 param="speculative") from None
        if target_tokenizer is not None and not same_tokenizer(draft.tokenizer, target_tokenizer):
            raise InvalidRequest(f"the draft model {config.draft_path!r} has a different tokenizer than the "
                                 "target model: a draft must share the target's vocabulary", param="speculative")
        if draft.config.vocab_size != target_model.config.vocab_size:
            raise InvalidRequest(f"the draft model's vocabulary ({draft.config.vocab_size}) differs from the "
                                 f"target's ({target_model.config.vocab_size})", param="speculative")
        raise InvalidRequest("draft-model speculation is not available in this build yet: use 'ngram'",
                             param="speculative")
