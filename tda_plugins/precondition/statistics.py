"""Inline K-FAC statistics, accumulated from the captured factors during training.

Per factorized layer (linear, Conv1D, LoRA, factor-projected):

    A = sum over token rows of [a;1][a;1]^T      (N_i' x N_i')
    S = sum over token rows of g g^T              (N_o x N_o)

divided by the number of real (non-padding) token rows when read. ``g`` is scaled by the
record's ``loss_scale``, i.e. taken under the store's per-example summed-loss convention.
Padding rows are excluded through the record's token mask, by multiplication (no host
sync). Each micro-batch's products are taken in the gradients' accumulation dtype (fp32
for fp32/bf16 models: the K-FAC products are as large as the backward's own, and fp64
ones cost twice as much) and summed across micro-batches in fp64, on the capture device;
layers fed by one input (q/k/v, gate/up) share one ``A`` product per micro-batch, and each
product adds to the upper triangle of the symmetric sum only (mirrored when read). The
statistics are written to the store directory (``rank-<r>/curvature.safetensors``,
atomically) at the end of capture and whenever :meth:`CurvatureAccumulator.save` is
called, so K-FAC, EK-FAC and LoGra need no second pass over the model. Embedding and norm
layers get no K-FAC factors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from tda_plugins.capture.config import CaptureConfig
from tda_plugins.capture.consumer import CaptureConsumer
from tda_plugins.capture.records import MicroBatchRecord
from tda_plugins.grads.factors import (
    TensorKey,
    TokenFactors,
    accumulation_dtype,
    tensor_key,
)
from tda_plugins.store.io import atomic_write
from tda_plugins.store.layout import CURVATURE_FILE, StoreError, rank_dir


@dataclass
class KroneckerFactors:
    """Uncentred second moments of one layer's factors.

    Attributes:
        a_sum: ``(N_i', N_i')`` fp64 sum of ``[a;1][a;1]^T`` over token rows.
        g_sum: ``(N_o, N_o)`` fp64 sum of ``g g^T`` over token rows.
        tokens: number of token rows summed (fp64 scalar tensor).
    """

    a_sum: Tensor
    g_sum: Tensor
    tokens: Tensor

    @property
    def a_cov(self) -> Tensor:
        """``A = E[a a^T]`` over token rows."""
        return self.a_sum / self.tokens

    @property
    def g_cov(self) -> Tensor:
        """``S = E[g g^T]`` over token rows."""
        return self.g_sum / self.tokens


def _token_rows(t: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(B, T', N)`` factor -> its ``(rows, N)`` token rows with padding rows zeroed, and
    their count (fp64 scalar).

    A module called ``k`` times on the sequence holds ``k T`` token rows (the calls are
    concatenated), so the ``(B, T)`` mask is tiled ``k`` times; rows of calls on other
    lengths cannot be matched to tokens and all count.
    """
    if mask is not None and mask.shape[0] == t.shape[0] and t.shape[1] % mask.shape[1] == 0:
        keep = mask.to(t.dtype).repeat(1, t.shape[1] // mask.shape[1]).unsqueeze(2)
        t, count = t * keep, keep.sum(dtype=torch.float64)
    else:
        count = torch.tensor(float(t.shape[0] * t.shape[1]), dtype=torch.float64, device=t.device)
    return t.reshape(-1, t.shape[2]), count


#: Widest Gram taken as one product; wider ones are halved (see :func:`add_upper_gram`).
_GRAM_LEAF = 200
#: A halved Gram splits at a multiple of this many columns (aligned panels).
_GRAM_ALIGN = 64


def add_upper_gram(out: Tensor, x: Tensor) -> None:
    """Add ``x^T x`` of ``(rows, n)`` ``x`` to the upper triangle (diagonal included) of
    the ``(n, n)`` ``out`` (any dtype: the product is taken in ``x``'s); entries below
    the diagonal may or may not be added to: read the sum through :func:`mirrored`.

    Halves the columns recursively: the two diagonal Grams recurse, the block above them
    is one rectangular product. That is about half the full product's multiply-adds,
    spent in the largest products the triangle allows (on the peer benchmark's GPT-2
    shapes, 1024 rows, 11-12% faster than equal 256-wide blocks of the upper triangle,
    which run below the GEMM's peak), and the block below is not written at all (5-7%
    less than adding its mirror each time).
    """
    n = x.shape[1]
    if n <= _GRAM_LEAF:
        out += (x.T @ x).to(out.dtype)
        return
    half = max(_GRAM_ALIGN, n // 2 // _GRAM_ALIGN * _GRAM_ALIGN)
    add_upper_gram(out[:half, :half], x[:, :half])
    add_upper_gram(out[half:, half:], x[:, half:])
    out[:half, half:] += (x[:, :half].T @ x[:, half:]).to(out.dtype)


def mirrored(upper: Tensor) -> Tensor:
    """The symmetric ``(n, n)`` matrix whose upper triangle (diagonal included) is
    ``upper``'s; its entries below the diagonal are ignored."""
    return upper.triu() + upper.triu(1).T


class CurvatureAccumulator(CaptureConsumer):
    """Consumer that accumulates :class:`KroneckerFactors` per factorized layer.

    Args:
        path: the gradient store directory the statistics are saved into.
        rank: this process's rank (each rank saves its own file; readers sum them).
        product_dtype: dtype of each micro-batch's products; ``None`` (default): the
            gradients' accumulation dtype (fp32 unless the model is fp64: the factors
            then carry fp32 rounding, ~1e-7 relative, which moves K-FAC scores by about
            1e-5 through the damped inverse); ``torch.float64``: exact fp64 products, at
            about twice the cost on CPU.
    """

    def __init__(self, path: str | Path, rank: int = 0, product_dtype: torch.dtype | None = None):
        self.root = Path(path)
        self.rank = rank
        self.product_dtype = product_dtype
        # running sums, exact in their upper triangles only (see add_upper_gram)
        self._sums: dict[str, KroneckerFactors] = {}

    @property
    def factors(self) -> dict[str, KroneckerFactors]:
        """Layer name -> its statistics so far (symmetric sums; each access builds them)."""
        return {
            name: KroneckerFactors(mirrored(s.a_sum), mirrored(s.g_sum), s.tokens.clone())
            for name, s in self._sums.items()
        }

    def on_attach(self, config: CaptureConfig) -> None:
        existing = rank_dir(self.root, self.rank) / CURVATURE_FILE
        if existing.exists() and not self._sums:  # an appending run keeps accumulating
            self._sums = _read(existing)

    def restore(self, path: str | Path) -> None:
        """Replace the statistics by those saved at ``path`` (a training checkpoint's copy,
        so that a run resumed from it counts every step exactly once)."""
        self._sums = _read(Path(path))

    def on_micro_batch(self, record: MicroBatchRecord) -> None:
        # Layers fed by one input (q/k/v, gate/up) share its A product: a lone layer's is
        # added straight into its running sum (no (N_i', N_i') temporary per micro-batch),
        # a shared one is taken once and added to each.
        groups: dict[tuple[TensorKey, bool], list[tuple[str, TokenFactors]]] = {}
        for name, layer in record.layers.items():
            if isinstance(layer.grads, TokenFactors):
                key = (tensor_key(layer.grads.a), layer.grads.bias)
                groups.setdefault(key, []).append((name, layer.grads))
        for group in groups.values():
            a, count = _token_rows(
                self._in_product_dtype(group[0][1].augmented_a()), record.token_mask
            )
            stats = [self._stats(name, grads, a) for name, grads in group]
            if len(stats) == 1:
                add_upper_gram(stats[0].a_sum, a)
            else:
                a_sum = torch.zeros(a.shape[1], a.shape[1], dtype=torch.float64, device=a.device)
                add_upper_gram(a_sum, a)
                for s in stats:
                    s.a_sum += a_sum
            for (_, grads), s in zip(group, stats, strict=True):
                g = grads.g.to(accumulation_dtype(grads.g)) * record.loss_scale
                g, _ = _token_rows(self._in_product_dtype(g), record.token_mask)
                add_upper_gram(s.g_sum, g)
                s.tokens += count

    def _stats(self, name: str, grads: TokenFactors, a: Tensor) -> KroneckerFactors:
        """Layer ``name``'s running sums, zero ones first (``a``: its ``(rows, N_i')``
        input rows)."""
        if name not in self._sums:
            n_i, n_o = a.shape[1], grads.out_dim
            self._sums[name] = KroneckerFactors(
                torch.zeros(n_i, n_i, dtype=torch.float64, device=a.device),
                torch.zeros(n_o, n_o, dtype=torch.float64, device=a.device),
                torch.zeros((), dtype=torch.float64, device=a.device),
            )
        return self._sums[name]

    def _in_product_dtype(self, t: Tensor) -> Tensor:
        return t if self.product_dtype is None else t.to(self.product_dtype)

    def on_end(self) -> None:
        self.save()

    def save(self, path: str | Path | None = None) -> None:
        """Write the statistics so far (atomically) to ``path``, by default into the store's
        rank directory."""
        target = Path(path) if path is not None else rank_dir(self.root, self.rank) / CURVATURE_FILE
        target.parent.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, stats in self.factors.items():
            tensors[f"{name}::A"] = stats.a_sum.cpu().contiguous()
            tensors[f"{name}::S"] = stats.g_sum.cpu().contiguous()
            tensors[f"{name}::tokens"] = stats.tokens.cpu().reshape(1)
        atomic_write(target, lambda tmp: save_file(tensors, tmp))  # streamed, no bytes copy


def _read(path: Path) -> dict[str, KroneckerFactors]:
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError) as error:
        raise StoreError(f"cannot read the K-FAC statistics {path} ({error}); recapture") from error
    names = {key.rsplit("::", 1)[0] for key in tensors}
    return {
        n: KroneckerFactors(tensors[f"{n}::A"], tensors[f"{n}::S"], tensors[f"{n}::tokens"][0])
        for n in names
    }


def load_curvature(root: str | Path) -> dict[str, KroneckerFactors]:
    """The K-FAC statistics of a store, summed over every rank that saved some."""
    files = sorted(Path(root).glob(f"rank-*/{CURVATURE_FILE}"))
    if not files:
        raise StoreError(
            f"{root} has no K-FAC statistics ({CURVATURE_FILE}); capture with curvature "
            "enabled (CurvatureAccumulator, `tda capture --curvature`) to use K-FAC/EK-FAC/LoGra"
        )
    total: dict[str, KroneckerFactors] = {}
    for path in files:
        for name, stats in _read(path).items():
            if name in total:
                t = total[name]
                total[name] = KroneckerFactors(
                    t.a_sum + stats.a_sum, t.g_sum + stats.g_sum, t.tokens + stats.tokens
                )
            else:
                total[name] = stats
    return total
