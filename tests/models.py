"""Tiny transformers causal LMs built from configs (no hub access), and batches for them."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 64
#: The attention the tiny models run (registered with transformers by ``tiny_causal_lm``).
ATTENTION = "eager_in_dtype"


def _eager_in_dtype(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention whose softmax stays in the model's dtype.

    Transformers' Llama-family eager attention takes its softmax in fp32, so an fp64
    model's padded and unpadded runs of one example differ at fp32 rounding, by an amount
    that depends on the CPU's vector width (1e-8 on the logits of an AMD EPYC, none on
    an AVX-512 Xeon): the fp64 oracles would measure the model's padding, not the engine.
    """
    groups = query.shape[1] // key.shape[1]  # grouped-query attention: repeat k/v heads
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    weights = (
        query @ key.transpose(2, 3) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    )
    if attention_mask is not None:
        weights = weights + attention_mask[:, :, :, : key.shape[-2]]
    weights = torch.nn.functional.dropout(weights.softmax(dim=-1), dropout, module.training)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION, _eager_in_dtype)
    AttentionMaskInterface.register(ATTENTION, eager_mask)


#: The Llama-family decoders' size (grouped-query attention: 4 heads, 2 key/value heads).
_DECODER: dict[str, int] = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)

_ARCHS = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
    ),
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        _DECODER,
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {**_DECODER, "tie_word_embeddings": False},
    ),
    "olmo2": (
        "Olmo2Config",
        "Olmo2ForCausalLM",
        _DECODER,
    ),
    # Gemma's word embedding is scaled (nn.Embedding times sqrt(hidden)), its head tied
    "gemma": (
        "GemmaConfig",
        "GemmaForCausalLM",
        {**_DECODER, "head_dim": 8},  # Gemma's default head_dim is 256
    ),
}
ARCHS = tuple(_ARCHS)


def tiny_causal_lm(
    arch: str,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    tie_word_embeddings: bool | None = None,
) -> nn.Module:
    """A 2-layer, 32-wide causal LM of architecture ``arch`` in ``dtype``, eval mode;
    ``tie_word_embeddings`` overrides the architecture's default (GPT-2 ties, Llama not)."""
    import transformers

    _register_attention()
    config_name, model_name, kwargs = _ARCHS[arch]
    if tie_word_embeddings is not None:
        kwargs = {**kwargs, "tie_word_embeddings": tie_word_embeddings}
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB, pad_token_id=0, attn_implementation=ATTENTION, **kwargs
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    return model.to(dtype).eval()


def with_lora(model: nn.Module, seed: int = 0) -> nn.Module:
    """PEFT LoRA (r=4) on every attention and MLP linear; B initialised non-zero."""
    from peft import LoraConfig, get_peft_model

    targets = "all-linear"
    lora = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:  # zero-initialised B would make every A gradient zero
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
    return lora


def lm_batch(
    batch: int = 3,
    length: int = 10,
    lengths: tuple[int, ...] | None = None,
    left_pad: bool = False,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Random token batch; ``lengths`` pads examples (right, or left) with mask 0, label -100.

    With left padding the last pad position would predict the first real token, a loss term
    the unpadded example does not have, so that label is -100 as well; and ``position_ids``
    count real tokens only (as ``generate`` does), so that absolute position embeddings
    (GPT-2) see the same positions as for the unpadded example.
    """
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    for i, n in enumerate(lengths or ()):
        if left_pad:
            mask[i, : length - n] = 0
        else:
            mask[i, n:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if left_pad:
        positions = mask.cumsum(dim=1) - 1
        out["labels"] = labels.masked_fill(positions <= 0, -100)
        out["position_ids"] = positions.clamp_min(0)
    return out
