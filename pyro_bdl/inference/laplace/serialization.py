"""A :class:`~.approximation.LaplaceFit` as JSON and tensors, and back (see
:mod:`..guide_state`).

The state is what :meth:`~.guide.LaplaceGuide.fit` and prior tuning leave: the MAP, the
prior precision :math:`\\delta` and the model's normal prior (mean and precision), the
log likelihood and gradient at the MAP (evidence, :attr:`mode_distance`), and the
curvature blocks in the form their questions are answered from: a diagonal, a dense
matrix, or a Kronecker block's two eigendecompositions. A K-FAC factor is saved as its
eigendecomposition (a sketched one as its rank-``k`` part), never as a ``d x d``
Kronecker product, and a factor that several layers share (LoRA's query and value A
read one input) is saved once and shared again when loaded.

A prior's mean and precision broadcast over the site (an IID prior is one number
expanded); they are saved unexpanded. A site whose prior is not a Normal has no prior
mean: its prior precision is the prior's own curvature at the MAP. An exact-Hessian fit
(a model without the GGN's structure) keeps the Hessian, no prior precision, and why;
its sites' transforms come from the model's trace, so it loads into a guide that has
run its model (``bdl.load`` runs it).
"""

from __future__ import annotations

import torch

from pyro_bdl.inference.laplace.approximation import LaplaceFit
from pyro_bdl.inference.laplace.curvature import (
    Curvature,
    Diagonal,
    DiagonalBlock,
    Full,
    FullBlock,
    Kron,
    KronBlock,
    KronLowRank,
)
from pyro_bdl.inference.laplace.curvature.factors import Eigen
from pyro_bdl.inference.laplace.hessian import HessianBlock
from pyro_bdl.inference.laplace.jacobians import ModelJacobians
from pyro_bdl.inference.laplace.model_prior import ModelPrior
from pyro_bdl.inference.sites import LatentSites

__all__ = ["laplace_state", "saved_sites", "restore_laplace", "curvature_from_settings"]


def laplace_state(fit: LaplaceFit | None, sites: LatentSites) -> tuple[dict, dict]:
    """The JSON and tensors of a fit (empty if None) of the latent ``sites``."""
    if fit is None:
        return {"fitted": False}, {}
    tensors = {"log_likelihood": torch.as_tensor(fit.log_likelihood).detach()}
    for name, loc in fit.loc.items():
        tensors[f"loc/{name}"] = loc
        if name in fit.prior_precision:
            tensors[f"prior_precision/{name}"] = fit.prior_precision[name]
        if name in fit.prior.precision:
            tensors[f"model_precision/{name}"] = _unexpanded(fit.prior.precision[name])
            tensors[f"prior_loc/{name}"] = _unexpanded(fit.prior.loc[name])
        if fit.gradient is not None:
            tensors[f"gradient/{name}"] = fit.gradient[name]
    factors: dict[int, int] = {}
    blocks = [_block_state(i, block, tensors, factors) for i, block in enumerate(fit.blocks)]
    state = {
        "fitted": True,
        "link": fit.link,
        "num_data": fit.num_data,
        "sites": list(fit.loc),
        "gradient": fit.gradient is not None,
        "blocks": blocks,
        "exact_hessian_reason": fit.exact_hessian_reason,
        "all_real": sites.all_real,
    }
    return state, tensors


def saved_sites(state: dict, tensors: dict[str, torch.Tensor]) -> LatentSites:
    """The latent sites of a saved fit, for a guide that has not run its model (a bare
    torch load): real sites of the saved shapes, or a refusal by name."""
    loc = {name: tensors[f"loc/{name}"] for name in state["sites"]}
    others = [name for name in loc if f"model_precision/{name}" not in tensors]
    if state.get("exact_hessian_reason") is not None or not state.get("all_real", True):
        what = "have constrained supports or it is an exact-Hessian fit, whose transforms"
    elif others:
        what = f"include {others[0]!r}, whose prior is not a Normal: its log density"
    else:
        return LatentSites.real(loc, "LaplaceGuide")
    raise RuntimeError(
        f"LaplaceGuide.load_state_dict: this fit's sites {what} come from the model: call "
        "the guide once with the model's arguments before loading, or use bdl.load"
    )


def restore_laplace(
    state: dict, tensors: dict[str, torch.Tensor], model, sites: LatentSites, temperature: float
) -> LaplaceFit:
    """The fit :func:`laplace_state` saved, for ``model`` with latent ``sites``."""
    loc = {name: tensors[f"loc/{name}"] for name in state["sites"]}
    reason = state.get("exact_hessian_reason")
    normal = [name for name in loc if f"model_precision/{name}" in tensors]
    others = {} if reason else {name: sites[name] for name in loc if name not in normal}
    prior = ModelPrior(
        loc={name: tensors[f"prior_loc/{name}"].expand(loc[name].shape) for name in normal},
        precision={
            name: tensors[f"model_precision/{name}"].expand(loc[name].shape) for name in normal
        },
        others=others,
        exact_hessian_reason=reason,
    )
    factors: dict[int, Eigen] = {}
    return LaplaceFit(
        loc=loc,
        blocks=tuple(
            _make_block(i, entry, tensors, factors) for i, entry in enumerate(state["blocks"])
        ),
        prior_precision={
            name: tensors[f"prior_precision/{name}"]
            for name in loc
            if f"prior_precision/{name}" in tensors
        },
        prior=prior,
        log_likelihood=tensors["log_likelihood"],
        num_data=state["num_data"],
        temperature=temperature,
        gradient={name: tensors[f"gradient/{name}"] for name in loc} if state["gradient"] else None,
        # the model linearised at the loaded MAP, for the predictive
        jacobians=None if reason else ModelJacobians(model, loc),
        link=state["link"],
    )


def _block_state(index: int, block, tensors: dict, factors: dict[int, int]) -> dict:
    """Describe one block, adding its tensors (a shared K-FAC factor once)."""
    if isinstance(block, DiagonalBlock):
        tensors[f"block/{index}/diagonal"] = block.curvature
        return {"type": "diagonal", "site": block.site}
    if isinstance(block, HessianBlock):
        tensors[f"block/{index}/hessian"] = block.hessian
        return {"type": "hessian", "shapes": [[site, list(s)] for site, s in block.shapes.items()]}
    if isinstance(block, FullBlock):
        tensors[f"block/{index}/matrix"] = block.curvature
        return {"type": "full", "shapes": [[site, list(s)] for site, s in block.shapes.items()]}
    if isinstance(block, KronBlock):
        ids = []
        for factor in (block.input_factor, block.output_factor):
            if id(factor) not in factors:
                number = factors[id(factor)] = len(factors)
                tensors[f"factor/{number}/vectors"] = factor.vectors
                tensors[f"factor/{number}/values"] = factor.values
            ids.append(factors[id(factor)])
        return {
            "type": "kron",
            "site": block.site,
            "shape": list(block.shape),
            "input": ids[0],
            "output": ids[1],
        }
    raise NotImplementedError(
        f"a Laplace block of type {type(block).__name__} cannot be saved; the diagonal, "
        "K-FAC and dense structures can"
    )


def _make_block(index: int, entry: dict, tensors: dict, factors: dict[int, Eigen]):
    """The block :func:`_block_state` described (shared factors shared again)."""
    if entry["type"] == "diagonal":
        return DiagonalBlock(entry["site"], tensors[f"block/{index}/diagonal"])
    if entry["type"] in ("full", "hessian"):
        shapes = {site: torch.Size(shape) for site, shape in entry["shapes"]}
        if entry["type"] == "hessian":
            return HessianBlock(shapes, tensors[f"block/{index}/hessian"])
        return FullBlock(shapes, tensors[f"block/{index}/matrix"])
    eigens = []
    for number in (entry["input"], entry["output"]):
        if number not in factors:
            vectors, values = (
                tensors[f"factor/{number}/vectors"],
                tensors[f"factor/{number}/values"],
            )
            factors[number] = Eigen(vectors=vectors, values=values)
        eigens.append(factors[number])
    return KronBlock(entry["site"], *eigens, shape=entry["shape"])


def _unexpanded(value: torch.Tensor) -> torch.Tensor:
    """The tensor a broadcast view (stride 0) was expanded from, with size 1 there."""
    index = tuple(slice(0, 1) if stride == 0 else slice(None) for stride in value.stride())
    return value[index]


def curvature_from_settings(settings: dict) -> Curvature:
    """The :class:`Curvature` whose ``hyperparameters()`` are ``settings``."""
    name, fisher, samples = settings["curvature"], settings["fisher"], settings["fisher_samples"]
    if name in ("diag_ggn", "diag_ef"):
        return Diagonal(fisher=fisher, num_samples=samples)
    if name == "kron":
        return Kron(fisher, samples, max_dense=settings["max_dense"], rank=settings["rank"])
    if name == "kron_lowrank":
        return KronLowRank(settings["rank"], fisher, samples)
    if name == "full":
        return Full(fisher, samples, max_params=settings["max_params"])
    raise ValueError(f"unknown curvature {name!r}; this pyro_bdl knows diag_*, kron*, full")
