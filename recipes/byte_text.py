"""Offline building blocks for the recipes' tiny default: real English text as bytes.

Paragraphs of Python's own reference documentation (``pydoc_data.topics``) are tokenized
as UTF-8 bytes (vocabulary 256, no tokenizer download), and a small Llama-architecture
model is built from a config. Decoding is exact, so reports show the real text.
"""

from __future__ import annotations

import random
import re
from pydoc_data.topics import topics

import torch
from torch import nn
from transformers import PreTrainedTokenizerFast

VOCAB = 256


def paragraphs(min_chars: int = 80, max_chars: int = 240) -> list[tuple[str, str]]:
    """``(section, paragraph)`` pairs of prose from the Python reference, in a fixed order."""
    out = []
    for section in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[section]):
            text = " ".join(block.split())
            if min_chars <= len(text) and text[0].isalpha() and text.isascii():
                out.append((section, text[:max_chars]))
    return out


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids: list[int]) -> str:
    return bytes(i for i in ids if 0 <= i < VOCAB).decode("utf-8", errors="replace")


def split_rows(count: int, queries: int, seed: int) -> tuple[list[dict], list[dict]]:
    """``count`` training rows and ``queries`` query rows (``input_ids`` and ``text``);
    each query is a training paragraph with a few words changed, so it has a clear
    nearest training example."""
    rng = random.Random(seed)
    pool = paragraphs()
    rng.shuffle(pool)
    train = [{"input_ids": encode(text), "text": text} for _, text in pool[:count]]
    picked = rng.sample(train, queries)
    query_rows = []
    for row in picked:
        words = row["text"].split()
        words[rng.randrange(len(words))] = "Python"
        text = " ".join(words)
        query_rows.append({"input_ids": encode(text), "text": text})
    return train, query_rows


def tiny_llama(seed: int = 0, hidden: int = 64, layers: int = 2) -> nn.Module:
    """A byte-level Llama-architecture model built from a config (no weights downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer for these byte ids, so TRL and reports can decode them (no download).

    Encoding raw text is not needed (the recipes pass ``input_ids``); decoding joins the
    bytes back into the text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {_byte_token(i): i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=_byte_token(0)))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=_byte_token(0), eos_token=_byte_token(10)
    )


def _byte_token(i: int) -> str:
    return chr(i) if 33 <= i < 127 else f"<0x{i:02X}>" if i != 32 else " "
