"""What produced a store: the model, its tokenizer, and the captured weights at the end.

Scores are only meaningful when the training store and the queries come from the same
model: the same architecture and configuration, the same tokenizer, and queries taken at
the weights the training run ended with. Shapes alone cannot tell (a fine-tune and its
base model have the same shapes), so each store records:

* ``model``: the model's class and its configuration (a transformers ``config.to_dict()``
  without the keys that describe how it was loaded, not what it computes);
* ``tokenizer``: the tokenizer's class and a digest of its vocabulary, when one is known;
* per rank, at the end of capture (``rank-<r>/end.json``): a digest of the captured
  modules' parameters (SHA-256 over every parameter's bytes, in layer order, a tied
  parameter once), one per captured layer (XXH3-128 over that layer's own parameters),
  one of the frozen base weights under the captured LoRA adapters (XXH3-128: an adapter
  put on another base model than it was trained on computes other gradients with the
  same adapter weights), and the dtypes of all of them (so that queries captured in
  another dtype are named as such). For a training store these are the
  final weights, the ones its queries must be captured at; for a query store, the
  weights it was captured at. Queries that hold the store's layers and more (a TRL run
  whose fused head leaves ``lm_head`` out of the training store) are checked layer by
  layer on the store's layers.

Cost: the weight digest copies each captured parameter to the host once and hashes it
(SHA-256 about 1 to 1.6 GB/s on one core, XXH3 about ten times that): about 30 s for 7B
weights; for LoRA adapters, the XXH3 of the base weights under them, about 0.3 s per GB
(SmolLM2-135M with LoRA on every linear layer: 0.17 s against 0.04 s without them).
A parameter sharded as a DTensor is gathered first (a collective: every rank computes
the digest at the end of capture).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from torch import nn

from tda_plugins.capture.names import modules_by_name
from tda_plugins.parallel.dtensor import gathered
from tda_plugins.utils.progress import end_of_run_bar

#: Configuration keys that say how a model was loaded or run, not what it computes. The
#: special token ids are among them: trainers align them with the tokenizer's at the
#: start of training (transformers' Trainer, TRL), so a run's model and the same model
#: loaded again for its queries differ there; the tokenizer is compared by vocabulary.
_VOLATILE = {
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "transformers_version",
    "architectures",
    "dtype",
    "torch_dtype",
    "use_cache",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
}


#: Configuration keys whose difference has a way out of its own, said after it.
_CONFIG_WAYS_OUT = {
    "quantization_config": (
        "one model was loaded quantized and the other not, or quantized otherwise (QLoRA "
        "trains an adapter on a quantized base): load the base model as the training run "
        "did; for tda capture, save the quantized base (save_pretrained after loading it "
        "with its quantization_config) and pass --model QUANTIZED_BASE --adapter ADAPTER"
    ),
}


def _config_of(model: nn.Module) -> dict[str, Any] | None:
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return None
    values = {k: v for k, v in to_dict().items() if not k.startswith("_") and k not in _VOLATILE}
    # through JSON, so that a fingerprint read back from disk compares equal
    return json.loads(json.dumps(values, sort_keys=True, default=str))


def _base(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (whose own class says nothing)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _class_name(model: nn.Module) -> str:
    """The model's own class name, past the subclass that ``torch.distributed``'s
    composable APIs swap in (``fully_shard`` makes ``FSDP<Class>``, ``replicate``
    ``DDP<Class>``), so that a sharded run and an unsharded one of a model agree."""
    own = (c for c in type(model).__mro__ if not c.__module__.startswith("torch.distributed."))
    return next(own).__name__


def model_fingerprint(model: nn.Module, tokenizer: Any = None) -> dict[str, Any]:
    """The model's class and configuration, and the tokenizer's class and vocabulary
    digest (``None`` without a tokenizer), as JSON values."""
    base = _base(model)
    token_digest = None
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if callable(get_vocab):
        vocab = json.dumps(sorted(get_vocab().items())).encode()
        token_digest = f"{type(tokenizer).__name__}:{hashlib.sha256(vocab).hexdigest()[:32]}"
    return {
        "model": {"class": _class_name(base), "config": _config_of(base)},
        "tokenizer": token_digest,
    }


@dataclass(frozen=True)
class WeightsDigest:
    """The captured weights at the end of a capture.

    Attributes:
        whole: SHA-256 hex digest over every captured parameter (name, dtype, shape and
            bytes, in layer order; a parameter shared by several modules once).
        layers: layer name -> XXH3-128 hex digest of its own parameters (a shared one in
            each layer that holds it), so that captures of different layer sets can be
            compared on the layers they share.
        base: XXH3-128 hex digest of the frozen base weights under the captured LoRA
            adapters (``None``: no adapter, or a store written before it was recorded).
        dtypes: the floating-point dtypes of the digested parameters, sorted (empty: not
            recorded); a quantized base's packed integer codes (bitsandbytes' uint8 and
            int8 weights) are hashed but are no dtype to capture queries in.
    """

    whole: str
    layers: dict[str, str]
    base: str | None = None
    dtypes: tuple[str, ...] = ()


def weights_digest(model: nn.Module, layers: Iterable[str]) -> WeightsDigest:
    """The :class:`WeightsDigest` of the captured modules ``layers`` of ``model``."""
    whole = hashlib.sha256()
    seen: set[int] = set()
    modules = modules_by_name(model)
    names = list(layers)
    owners = list(dict.fromkeys(n.partition(".lora_")[0] for n in names if ".lora_" in n))
    bases = [
        (o, base)
        for o in owners
        if isinstance(base := getattr(modules[o], "base_layer", None), nn.Module)
    ]
    params = {
        id(p): p
        for module in [*(modules[n] for n in names), *(m for _, m in bases)]
        for p in module.parameters()
    }
    total = sum(p.numel() * p.element_size() for p in params.values())
    per_layer = {}
    dtypes: set[str] = set()
    base = xxhash.xxh3_128()
    with end_of_run_bar(total, "weights digest") as bar:
        for layer in names:
            per_layer[layer] = _digest_layer(modules[layer], layer, whole, seen, bar, dtypes)
        for owner, module in bases:
            _digest_layer(module, f"{owner}.base_layer", base, set(), bar, dtypes)
    return WeightsDigest(
        whole.hexdigest(),
        per_layer,
        base.hexdigest() if bases else None,
        tuple(sorted(dtypes)),
    )


def _digest_layer(
    module: nn.Module, layer: str, whole: Any, seen: set[int], bar: Any, dtypes: set[str]
) -> str:
    """Feed the parameters of ``module`` (the layer ``layer``) not in ``seen`` to
    ``whole`` and their dtypes to ``dtypes``; its own digest."""
    own = xxhash.xxh3_128()
    for local, param in module.named_parameters():
        value = gathered(param.detach()).cpu().contiguous()
        if value.is_floating_point():  # not a quantized base's packed integer codes
            dtypes.add(str(value.dtype).removeprefix("torch."))
        tag = f"{layer}.{local}:{value.dtype}:{tuple(value.shape)};".encode()
        data = value.view(-1).view(torch.uint8).numpy().data  # the bytes, not a copy
        own.update(tag)
        own.update(data)
        if id(param) not in seen:
            seen.add(id(param))
            whole.update(tag)
            whole.update(data)
            bar.update(value.numel() * value.element_size())
    return own.hexdigest()


def fingerprint_differences(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[str]:
    """What differs between two :func:`model_fingerprint` values (empty when they agree;
    an unknown tokenizer on either side is not a difference)."""
    out = []
    a, b = ours.get("model", {}), theirs.get("model", {})
    if a.get("class") != b.get("class"):
        out.append(f"model class {a.get('class')} vs {b.get('class')}")
    config_a, config_b = a.get("config") or {}, b.get("config") or {}
    keys = sorted(k for k in set(config_a) | set(config_b) if config_a.get(k) != config_b.get(k))
    if keys:
        shown = ", ".join(f"{k}={config_a.get(k)!r} vs {config_b.get(k)!r}" for k in keys[:3])
        more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
        out.append(f"model config {shown}{more}")
        out += [_CONFIG_WAYS_OUT[k] for k in keys if k in _CONFIG_WAYS_OUT]
    tok_a, tok_b = ours.get("tokenizer"), theirs.get("tokenizer")
    if tok_a is not None and tok_b is not None and tok_a != tok_b:
        out.append(f"tokenizer {tok_a} vs {tok_b}")
    return out


def weights_differences(
    ours: WeightsDigest, theirs: WeightsDigest, layers: Sequence[str] | None = None
) -> list[str]:
    """Why queries whose end-of-capture weights are ``theirs`` were not captured at the
    weights ``ours`` (a training store's) ended with; empty when they were.

    ``layers`` is ``None`` when both captures hold the same layers (the whole digests are
    compared); otherwise the store's layers, which the queries hold with others, compared
    one by one.
    """
    dtypes = (
        [
            f"the queries' weights are {'/'.join(theirs.dtypes)}, the store's "
            f"{'/'.join(ours.dtypes)}: capture the queries in the store's dtype "
            f"(tda capture --dtype {ours.dtypes[0]})"
        ]
        if ours.dtypes and theirs.dtypes and ours.dtypes != theirs.dtypes
        else []
    )
    if layers is None:
        if ours.whole != theirs.whole:
            return dtypes or [
                "the queries were captured at other weights than the training run ended with"
            ]
        if ours.base is not None and theirs.base is not None and ours.base != theirs.base:
            return dtypes or [
                "the queries' LoRA adapter sits on another base model than the training "
                "run's (its frozen weights differ): load the base model the adapter was "
                "trained on"
            ]
        return []
    unknown = [n for n in layers if n not in ours.layers or n not in theirs.layers]
    if unknown:
        return [
            "the queries hold more layers than the store, and one of them was written by a "
            "tda-plugins that did not record each layer's weights, so they cannot be checked "
            "layer by layer: capture the queries with the store's layers"
        ]
    differ = [n for n in layers if ours.layers[n] != theirs.layers[n]]
    if differ:
        return dtypes or [
            "the queries were captured at other weights than the training run ended with "
            f"(layers {differ[:3]})"
        ]
    return []
