"""traker: ``TRAKer`` at one checkpoint (``load_checkpoint`` + ``featurize`` over the
training rows, ``finalize_features``, then ``start_scoring_checkpoint`` + ``score`` over
the queries and ``finalize_scores``), on ``torch.func`` per-example gradients
(``FunctionalGradientComputer``: ``vmap`` of ``grad`` over every parameter, then kept for
``grad_wrt`` = the chosen layers' weights and biases), its store an mmap under the
problem's scratch folder.

TRAK proper is not run: its two documented extension points make the scores a plain
gradient dot. The model output function is each example's summed token loss with
out-to-loss weight 1 (TRAK's ``Q``), and the score computer keeps the features as they
are (no ``(Phi^T Phi)^-1``). What remains is TRAKer's projection: none
(``NoOpProjector``: an ``(N, D)`` float32 store on disk) for GradDot, and on CPU its
``BasicProjector`` -- a dense Gaussian JL matrix over the whole flattened gradient, not a
factor projection -- with ``proj_dim = k*k`` for the projected row. TRAKer divides every
projected gradient by ``sqrt(D)``, and its Gaussian matrix is not normalised (dots grow
by ``proj_dim``): the scores are multiplied back by ``D`` (``D / proj_dim`` projected)."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from trak import TRAKer
from trak.modelout_functions import AbstractModelOutput
from trak.projectors import AbstractProjector, NoOpProjector
from trak.score_computers import AbstractScoreComputer

from peers.base import PeerAdapter, register_peer
from peers.workload import Problem, parameter_names, row_batches
from tda_plugins import causal_lm_example_losses


class _SummedLoss(AbstractModelOutput):
    """Model output ``f`` = the example's own summed next-token loss; ``Q = 1``."""

    def __init__(self) -> None:
        super().__init__()

    @staticmethod
    def get_output(
        model: nn.Module, weights: dict[str, Tensor], buffers: dict[str, Tensor], ids: Tensor
    ) -> Tensor:
        # One (T,) row under vmap; an unbatched all-ones mask keeps transformers' mask
        # checks off the vmapped ids (data-dependent control flow).
        rows = ids[None]
        inputs = {"input_ids": rows, "attention_mask": torch.ones(rows.shape, dtype=torch.long)}
        logits = functional_call(model, (weights, buffers), (), inputs).logits
        return causal_lm_example_losses(logits, rows)[0]

    def get_out_to_loss_grad(
        self,
        model: nn.Module,
        weights: dict[str, Tensor],
        buffers: dict[str, Tensor],
        batch: Iterable[Tensor],
    ) -> Tensor:
        (ids,) = batch
        return torch.ones(ids.shape[0], 1)


class _PlainDot(AbstractScoreComputer):
    """Scores ``features @ target_grads^T`` of the stored gradients as they are."""

    def __init__(self, dtype: torch.dtype, device: Any, **_: Any) -> None:
        super().__init__(dtype, device)

    def get_xtx(self, grads: Tensor) -> Tensor:
        # TRAKer calls this before get_x_xtx_inv; nothing is inverted here.
        return grads.new_empty(0)

    def get_x_xtx_inv(self, grads: Tensor, xtx: Tensor) -> Tensor:
        return grads

    def get_scores(self, features: Tensor, target_grads: Tensor, accumulator: Tensor) -> None:
        accumulator += (features @ target_grads.T).cpu()


@register_peer
class Traker(PeerAdapter):
    """traker 0.3 on CPU, fp32 (``use_half_precision=False``), one checkpoint."""

    name = "traker"
    clears_scratch = True

    def scores(self, problem: Problem, method: str) -> Tensor:
        model = problem.model
        work = self.scratch(problem)
        # A fresh folder; load_from_save_dir stays True: traker 0.3.2 writes the
        # experiments.json that start_scoring_checkpoint reads only in that mode.
        shutil.rmtree(work, ignore_errors=True)
        # A Gaussian JL matrix scales every dot by proj_dim on average; no projection, by 1.
        projector: AbstractProjector | None = None
        proj_dim = gain = problem.k * problem.k
        if method == "graddot":
            projector, proj_dim, gain = NoOpProjector(device=str(problem.device)), 0, 1
        traker = TRAKer(
            model=model,
            task=_SummedLoss(),
            train_set_size=problem.train.shape[0],
            save_dir=str(work),
            device=str(problem.device),
            projector=projector,
            score_computer=_PlainDot,
            proj_dim=proj_dim,
            logging_level=logging.WARNING,
            use_half_precision=False,
            grad_wrt=parameter_names(model, problem.layers),
        )
        state = model.state_dict()
        traker.load_checkpoint(state, model_id=0)
        for ids in row_batches(problem.train, problem.batch):
            traker.featurize(batch=(ids,), num_samples=ids.shape[0])
        traker.finalize_features()
        queries = problem.queries.shape[0]
        traker.start_scoring_checkpoint("queries", state, model_id=0, num_targets=queries)
        for ids in row_batches(problem.queries, problem.batch):
            traker.score(batch=(ids,), num_samples=ids.shape[0])
        scores = torch.from_numpy(traker.finalize_scores("queries").copy()).T
        return scores * traker.normalize_factor**2 / gain
