"""A tiny byte-level BPE tokenizer saved beside a test checkpoint, as transformers saves one.

Specials take ids 0-2 (<pad>, <s>, </s>) to match make_checkpoint's pad/bos/eos ids.
"""
from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = [
    "Once upon a time there was a small model that served text over gRPC.",
    "The quick brown fox jumps over the lazy dog. Numbers: 0123456789.",
    "Paged attention keeps the KV cache in blocks; continuous batching keeps the GPU busy.",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🙂 and more unicode ✓.",
] * 20


def make_tokenizer(path: str | Path, vocab_size: int = 320, chat_template: str = CHAT_TEMPLATE,
                   more_special_tokens: tuple[str, ...] = ()) -> Path:
    """`more_special_tokens` take the ids after the three specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=["<pad>", "<s>", "</s>", *more_special_tokens],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return Path(path)
