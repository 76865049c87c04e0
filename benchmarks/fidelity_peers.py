"""Peer libraries in the fidelity benchmark, through the adapters of ``benchmarks/peers``.

Each (library, method) pair of the peer harness (:data:`peers.base.LIBRARIES` x
:data:`peers.workload.METHODS`) whose library is installed and is not our own package is
registered as the attributor ``"library:method"`` (``"kronfluence:ekfac"``). It hands the
adapter the same problem our methods solve: the trained model (fp32, eval mode, a fresh
copy per call), every training block (K-FAC / EK-FAC statistics come from all of them, as
ours do), the validation blocks as queries, the layers of :data:`fidelity_methods.LAYERS`
(GPT-2's Conv1D layers), batch 32 and projection ``k = 32`` per side (our LoGra's).
Adapters use each example's summed token loss and "higher = more helpful", the
benchmark's sign; damping is 0.1 x the mean eigenvalue where the library exposes it (the
adapters' notes say what each ran).

TRAK (``traker``) has no adapter in ``benchmarks/peers`` yet; :class:`Trak` is its glue
here, registered as ``"traker:trak"`` (TRAK is its own method, none of the four above).

A library that cannot run a method (no adapter, no such method, an import or run error)
raises :class:`~peers.base.Unsupported` with the version and the reason, which the
benchmark reports instead of a score. Libraries that are not installed (the main venv, CI)
register nothing, and no peer library is imported before its attributor runs. Warnings a
library raises while it runs (deprecations aside) are kept with its row: they say when it
fell back to something other than what was asked.
"""

from __future__ import annotations

import logging
import traceback
import warnings
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any, ClassVar

import torch
from fidelity_methods import LAYERS, FidelityTask, register_attributor
from peers.base import LIBRARIES, PeerAdapter, Unsupported, adapter, library_version
from peers.workload import METHODS, Problem, row_batches
from torch import Tensor, nn

#: Our LoGra's factor projection size per side, for the peers' projected GradDot.
PROJECTION_K = 32
#: TRAK's projection dimension: below the 512 training blocks, so that ``X^T X`` is
#: invertible without a ridge term (TRAK's default, 2048, is for far larger training sets).
TRAK_DIM = 256


class _CausalLMMargin:
    """TRAK's model output for a causal LM (the protocol of ``trak``'s
    ``AbstractModelOutput``): ``f(z) = sum_t log(p_t / (1 - p_t))``, the logit margin of
    each next token ``t`` summed over the block, and the out-to-loss weight
    ``Q = mean_t (1 - p_t)``, TRAK's classification margin applied token by token."""

    @staticmethod
    def get_output(
        model: nn.Module, weights: dict[str, Tensor], buffers: dict[str, Tensor], ids: Tensor
    ) -> Tensor:
        """Scalar margin of one ``(T,)`` block under ``weights`` (called under ``vmap``)."""
        out = torch.func.functional_call(model, (weights, buffers), (), {"input_ids": ids[None]})
        logp = _next_token_logp(out.logits, ids[None])
        return (logp - torch.log1p(-logp.exp())).sum()

    def get_out_to_loss_grad(
        self,
        model: nn.Module,
        weights: dict[str, Tensor],
        buffers: dict[str, Tensor],
        batch: tuple[Tensor],
    ) -> Tensor:
        """``(B, 1)`` mean ``1 - p_t`` of each block of the batch."""
        (ids,) = batch
        with torch.no_grad():
            out = torch.func.functional_call(model, (weights, buffers), (), {"input_ids": ids})
            return (1 - _next_token_logp(out.logits, ids).exp()).mean(dim=1, keepdim=True)


def _next_token_logp(logits: Tensor, ids: Tensor) -> Tensor:
    """``(B, T - 1)`` log-probability of each next token."""
    logp = logits[:, :-1].log_softmax(dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)


class Trak(PeerAdapter):
    """traker 0.3: ``TRAKer`` with one checkpoint (the trained weights; TRAK's ensemble
    over independently trained models is not available here), on CPU (its
    ``BasicProjector``), fp32, gradients of the chosen layers only (``grad_wrt``)."""

    name = "traker"
    notes: ClassVar[dict[str, str]] = {
        "trak": f"TRAKer, 1 checkpoint, proj_dim={TRAK_DIM} (rademacher, BasicProjector), "
        "lambda_reg=0, output = summed next-token logit margin, Q = mean (1 - p)",
    }

    def scores(self, problem: Problem, method: str) -> Tensor:
        # Imported here: this module is imported where traker is not installed.
        from trak import TRAKer

        model = problem.model
        chosen = [f"{n}.{p}" for n in problem.layers for p in ("weight", "bias")]
        traker = TRAKer(
            model=model,
            task=_CausalLMMargin(),  # duck-typed: TRAKer only calls the two methods
            train_set_size=problem.train.shape[0],
            save_dir=str(problem.work / "trak"),
            device="cpu",
            proj_dim=TRAK_DIM,
            use_half_precision=False,
            grad_wrt=chosen,
            logging_level=logging.WARNING,
        )
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        traker.load_checkpoint(weights, model_id=0)
        for ids in row_batches(problem.train, problem.batch):
            traker.featurize(batch=(ids,), num_samples=ids.shape[0])
        traker.finalize_features()
        traker.start_scoring_checkpoint("fidelity", weights, 0, problem.queries.shape[0])
        for ids in row_batches(problem.queries, problem.batch):
            traker.score(batch=(ids,), num_samples=ids.shape[0])
        return torch.as_tensor(traker.finalize_scores("fidelity")).T


#: Adapters written here for libraries that ``benchmarks/peers`` has none for yet, with
#: the methods each runs.
LOCAL_ADAPTERS: dict[str, tuple[type[PeerAdapter], tuple[str, ...]]] = {
    "traker": (Trak, ("trak",)),
}


@dataclass
class PeerAttributor:
    """One peer library's method as a fidelity attributor.

    Attributes:
        library: a key of :data:`peers.base.LIBRARIES`.
        method: one of :data:`peers.workload.METHODS` (or a local adapter's method).
        warned: the distinct warnings the library raised during its last run.
    """

    library: str
    method: str
    warned: list[str] = field(default_factory=list)

    def __call__(self, task: FidelityTask) -> Tensor:
        """``(M, N)`` fp64 scores of the validation blocks against every training block;
        raises :class:`Unsupported` with the library version and the reason when the
        library cannot run the method. Cost: the adapter's capture + score call over all
        ``N`` training blocks and ``M`` validation blocks."""
        peer = self.adapter()
        model = task.trained_model().eval()
        problem = Problem(
            model=model,
            train=task.train,
            queries=task.validation,
            layers=tuple(LAYERS.resolve(model)),
            batch=task.batch,
            k=PROJECTION_K,
            work=task.work / self.library / self.method,
        )
        try:
            peer.check(self.method)
            peer.cleanup(problem)  # what an interrupted earlier run left
            problem.work.mkdir(parents=True, exist_ok=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                scores = peer.scores(peer.prepare(problem, self.method), self.method)
            peer.cleanup(problem)
            self.warned[:] = list(
                dict.fromkeys(
                    _first_sentence(w.message)
                    for w in caught
                    if not issubclass(w.category, (DeprecationWarning, FutureWarning))
                )
            )
        except Unsupported:
            raise
        except Exception as error:  # a peer's failure is a result: its row says why
            last = traceback.format_exception_only(error)[-1].strip()
            raise Unsupported(f"{peer.version_text()}: {last[:300]}") from error
        return scores.double()

    def adapter(self) -> PeerAdapter:
        """The library's adapter (a local one first); :class:`Unsupported` when it has
        none or it does not import."""
        if self.library in LOCAL_ADAPTERS:
            return LOCAL_ADAPTERS[self.library][0]()
        try:
            return adapter(self.library)
        except ImportError as missing:
            raise Unsupported(
                f"{library_version(self.library)}: cannot import ({missing})"
            ) from missing

    @property
    def note(self) -> str:
        """What the library ran for this method (the adapter's note) and the warnings it
        raised, or ``""``."""
        try:
            parts = [self.adapter().notes.get(self.method, "")]
        except Unsupported:
            parts = []
        parts += [f"the library warned: {w}" for w in self.warned]
        return "; ".join(p for p in parts if p)

    @property
    def version(self) -> str:
        """``distribution version`` of the library."""
        return library_version(self.library)


def _first_sentence(message: Any, limit: int = 300) -> str:
    """The first sentence of a warning's message, at most ``limit`` characters."""
    text = " ".join(str(message).split())
    return text.split(". ")[0][:limit]


def installed(library: str) -> bool:
    """Whether ``library``'s distribution is installed (without importing it)."""
    try:
        version(LIBRARIES[library].distribution)
    except PackageNotFoundError:
        return False
    return True


#: Our own package's entries in the peer harness (our engine in its adapters) are not peers.
_OURS = LIBRARIES["ours"].distribution
for _library, _entry in LIBRARIES.items():
    if _entry.distribution != _OURS and installed(_library):
        _methods = LOCAL_ADAPTERS[_library][1] if _library in LOCAL_ADAPTERS else METHODS
        for _method in _methods:
            register_attributor(f"{_library}:{_method}")(PeerAttributor(_library, _method))
