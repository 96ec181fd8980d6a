from kvserve.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer"]
