"""What one micro-batch adds to a layer's K-FAC sums, per captured representation.

Each representation says which rows' Gram (``rows^T rows``) adds to a dense factor, or
which vector adds to a diagonal one (docs/design.md section 8):

* :class:`~tda_plugins.grads.tokens.TokenFactors` (linear, Conv1D, LoRA, factor-projected
  layers): ``A`` from the token rows of ``[a; 1]``, ``S`` from those of ``g`` (its
  diagonal ``sum g * g`` for a tied head's vocabulary-wide output);
* :class:`~tda_plugins.grads.embedding.EmbeddingFactors`: ``A`` is diagonal, the count of
  each token id over the rows (the sum of the one-hot inputs' outer products), ``S`` from
  the rows of ``g``;
* :class:`~tda_plugins.grads.dense.DenseGrad` (norm scales): no ``A``; ``S`` from the
  ``B`` per-example gradients themselves, counted in token rows like the others (so that
  its ``S / tokens`` is on the per-token scale of the Kronecker factors).

``g`` is taken under the store's loss convention (``loss_scale`` applied). Padding rows are
zeroed by multiplying with the record's token mask (no host sync) and not counted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import singledispatch

import torch
from torch import Tensor

from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.grads.base import PerExampleGrad, tensors_of, values_dtype
from tda_plugins.grads.blocks import TensorKey, accumulation_dtype, tensor_key
from tda_plugins.grads.dense import DenseGrad
from tda_plugins.grads.embedding import EmbeddingFactors
from tda_plugins.grads.tokens import TokenFactors
from tda_plugins.precondition.forms import FactorSpec


@dataclass
class Contribution:
    """One micro-batch's addition to one layer's sums.

    Attributes:
        a: for a dense ``A``, the ``(rows, n_a)`` rows whose Gram adds to it (layers fed
            by one input share this tensor); for a diagonal one, the ``(n_a,)`` vector
            added to it; ``None`` for a layer without ``A``.
        s: the same for ``S``.
        tokens: token rows counted (fp64 scalar).
    """

    a: Tensor | None
    s: Tensor
    tokens: Tensor


class Products:
    """Computes the contributions of one record's layers, sharing the input rows of
    layers fed by one input (q/k/v, gate/up: one ``[a; 1]`` tensor).

    Args:
        record: the micro-batch.
        dtype: dtype of the products (``None``: each gradient's accumulation dtype).
    """

    def __init__(self, record: MicroBatchRecord, dtype: torch.dtype | None):
        self.record = record
        self.dtype = dtype
        self._inputs: dict[tuple[TensorKey, bool], tuple[Tensor, Tensor]] = {}

    def __call__(self, grads: PerExampleGrad, spec: FactorSpec) -> Contribution:
        """``grads``' contribution to sums of the forms of ``spec``."""
        return _contribution(grads, spec, self)

    def forget(self) -> None:
        """Drop the shared input rows (a group of layers fed by one input is done)."""
        self._inputs.clear()

    def dtype_and_device(self, layers: Iterable[str]) -> tuple[torch.dtype, torch.device]:
        """The products' dtype and device: those of the first of ``layers`` the record
        holds (fp32 on the CPU when it holds none)."""
        grads = next((self.record.layers[n].grads for n in layers if n in self.record.layers), None)
        if grads is None:
            return self.dtype or torch.float32, torch.device("cpu")
        return self.dtype or values_dtype(grads), tensors_of(grads)[0].device

    def rows(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """``(B, T', N)`` -> its ``(rows, N)`` token rows in the product dtype, padding
        rows zeroed, and their count (fp64 scalar).

        A module called ``k`` times on the sequence holds ``k T`` token rows (the calls are
        concatenated), so the ``(B, T)`` mask is tiled ``k`` times; rows of calls on other
        lengths cannot be matched to tokens and all count.
        """
        t = t if self.dtype is None else t.to(self.dtype)
        keep, count = self.keep(t.shape[0], t.shape[1], t.dtype, t.device)
        if keep is not None:
            t = t * keep.unsqueeze(2)
        return t.reshape(-1, t.shape[2]), count

    def keep(
        self, batch: int, tokens: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[Tensor | None, Tensor]:
        """``(B, T')`` weights, 1 at real token rows and 0 at padding (``None``: every
        row counts), and the number of real rows (fp64 scalar)."""
        mask = self.record.token_mask
        if mask is not None and mask.shape[0] == batch and tokens % mask.shape[1] == 0:
            keep = mask.to(dtype).repeat(1, tokens // mask.shape[1])
            return keep, keep.sum(dtype=torch.float64)
        return None, torch.tensor(float(batch * tokens), dtype=torch.float64, device=device)

    def input_rows(self, grads: TokenFactors) -> tuple[Tensor, Tensor]:
        """:meth:`rows` of ``[a; 1]``, computed once per input tensor."""
        key = (tensor_key(grads.a), grads.bias)
        if key not in self._inputs:
            self._inputs[key] = self.rows(grads.augmented_a())
        return self._inputs[key]

    def output_rows(self, g: Tensor) -> Tensor:
        """:meth:`rows` of ``g`` under the store's convention (``loss_scale`` applied)."""
        return self.rows(g.to(accumulation_dtype(g)) * self.record.loss_scale)[0]

    def token_count(self, device: torch.device) -> Tensor:
        """The micro-batch's real tokens (fp64 scalar): its mask's count, else every
        position of its ``input_ids``."""
        if self.record.token_mask is not None:
            return self.record.token_mask.sum(dtype=torch.float64)
        if self.record.input_ids is not None:
            count = float(self.record.input_ids.numel())
            return torch.tensor(count, dtype=torch.float64, device=device)
        raise ValueError(
            "K-FAC statistics of a norm scale count the micro-batch's tokens, but the model "
            "was called without attention_mask or input_ids; pass one of them, or capture "
            "without norm layers (LayerSelection kind='linear')"
        )


def _diagonal_if(rows: Tensor, form: str) -> Tensor:
    """``rows`` for a dense factor, the diagonal of their Gram for a diagonal one."""
    return rows.square().sum(dim=0) if form == "diagonal" else rows


@singledispatch
def _contribution(grads: PerExampleGrad, spec: FactorSpec, products: Products) -> Contribution:
    raise TypeError(f"no K-FAC statistics for a {type(grads).__name__} capture")


@_contribution.register
def _(grads: TokenFactors, spec: FactorSpec, products: Products) -> Contribution:
    a, count = products.input_rows(grads)
    return Contribution(a, _diagonal_if(products.output_rows(grads.g), spec.s_form), count)


@_contribution.register
def _(grads: EmbeddingFactors, spec: FactorSpec, products: Products) -> Contribution:
    g = products.output_rows(grads.g)
    keep, count = products.keep(grads.batch_size, grads.tokens, g.dtype, g.device)
    ones = torch.ones_like(grads.ids, dtype=g.dtype) if keep is None else keep
    counts = g.new_zeros(grads.num_embeddings).index_add_(0, grads.ids.flatten(), ones.flatten())
    return Contribution(counts, g, count)


@_contribution.register
def _(grads: DenseGrad, spec: FactorSpec, products: Products) -> Contribution:
    values = grads.materialize()
    if products.dtype is not None:
        values = values.to(products.dtype)
    return Contribution(
        None, values * products.record.loss_scale, products.token_count(values.device)
    )
