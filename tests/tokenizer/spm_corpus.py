"""SentencePiece models trained on an inline corpus, for the tokenizer tests (the `spm_files`
fixture in conftest.py writes them into vocab-only GGUF files). Test modules import from here, not
from conftest: a module named `conftest` is ambiguous when several test folders run in one process."""

from __future__ import annotations

_BASE = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i * i); }  // squares",
    "SELECT name, count(*) FROM users WHERE age >= 18 GROUP BY name ORDER BY 2 DESC;",
    "Numbers: 3.14159, 2.71828, 1000000, 42, -7, 1e-9, 0xFF, 2024-06-01 12:30:45.",
    "Le café est très bon, n'est-ce pas ? Über den Wolken muss die Freiheit wohl grenzenlos sein.",
    "¿Dónde está la biblioteca? Ça va très bien, merci beaucoup à vous.",
    "Москва — столица России. Привет, как дела? Всё хорошо, спасибо.",
    "東京は日本の首都です。今日はいい天気ですね。我喜欢学习中文。",
    "Γειά σου κόσμε. Η γλώσσα είναι όμορφη. مرحبا بالعالم. שלום עולם.",
    "Emoji: 😀 😂 🎉 👍🏽 ❤️ 🚀 — and symbols ©®™ ∑∫√∞ ≤≥ ← → ★",
    "Whitespace   runs\t\ttabs\n\n\nnewlines    and  double  spaces   end.   ",
    "<html><body><div class=\"main\">Hello, world!</div></body></html>",
    "JSON: {\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}",
    "I can't, you won't, they're, we've, she'll, he'd, it's — contractions.",
]
CORPUS_TRAIN = [line for _ in range(4) for line in _BASE] + [
    f"Line {i}: value={i * 37 % 101} item_{i} status {'ok' if i % 3 else 'fail'}." for i in range(300)]

# Text the tests tokenize: the training kinds plus text the models never saw (rare scripts and
# characters that need byte fallback, long whitespace runs, special tokens written in text).
TEST_TEXTS = _BASE + [
    "", " ", "  ", "\n", "a", " leading space", "trailing space ", "   three leading",
    "ሰላም ልዑል — Amharic; ᚠᚢᚦᚨᚱᚲ runes; 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math; 🦩🪼 new emoji; ⅷ ℵ ﬁ ligature",
    "Zero\u200bwidth\u00a0nbsp\u3000ideographic space\ufeffbom",
    "x" * 40 + " " + "=" * 33 + " " + "0" * 25 + " " + "\t" * 7 + " " * 17 + "end",
    "mixed<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "a <tool> call</s> and <s> text <unk> with <0x41> look-alikes",
    "<|system|>\nBe brief.<|end|>\n<|user|>\n  Hi!  <|end|>\n<|assistant|>\nHello.<|end|><|endoftext|>",
    "    def method(self):\n        return {'a': 1}  # comment\n\n\n",
    "1234567890 12 345 6789 3.0e10 -0.5 1,000,000 ½ ¾ ²³",
    "combining: e\u0301 a\u0308 n\u0303 — Hangul: 한국어 텍스트 — Thai: ภาษาไทย — Hindi: नमस्ते दुनिया",
]

# (name, model_type, vocab_size, add_dummy_prefix)
KINDS = [
    ("bpe-400", "bpe", 400, True),
    ("bpe-1000", "bpe", 1000, True),
    ("bpe-2000-noprefix", "bpe", 2000, False),
    ("unigram-600", "unigram", 600, True),
    ("unigram-1500-noprefix", "unigram", 1500, False),
]


PHI3_CONTROL = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>", "<|system|>"]


def train_spm(out_prefix, model_type: str, vocab_size: int, add_dummy_prefix: bool,
              control: tuple[str, ...] = ()) -> str:
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS_TRAIN), model_writer=buf, model_type=model_type, vocab_size=vocab_size,
        hard_vocab_limit=False, byte_fallback=True, character_coverage=0.98, add_dummy_prefix=add_dummy_prefix,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        control_symbols=["<start_of_turn>", "<end_of_turn>", *control], user_defined_symbols=["<tool>"],
        allow_whitespace_only_pieces=True, num_threads=1, minloglevel=2)
    path = f"{out_prefix}.model"
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    return path
