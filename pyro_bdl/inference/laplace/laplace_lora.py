"""Laplace-LoRA's post-hoc recipe in one call: :func:`fit_laplace_lora`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from pyro_bdl._checks import one_of
from pyro_bdl.inference.laplace.curvature import Curvature
from pyro_bdl.inference.laplace.guide import LaplaceGuide
from pyro_bdl.inference.laplace.predictive import LINKS

__all__ = ["fit_laplace_lora"]


def fit_laplace_lora(
    model: Callable,
    train_loader: Iterable,
    num_data: int,
    validation_loader: Iterable | None = None,
    *,
    map: bool | Mapping[str, torch.Tensor] = False,
    curvature: str | Curvature = "kron",
    num_steps: int = 1000,
    links: Sequence[str] = LINKS,
    num_samples: int = 100,
    progress: bool = True,
) -> tuple[LaplaceGuide, str, dict[str, float] | None]:
    r"""The Laplace approximation of a fine-tuned network, as Laplace-LoRA makes it.

    Three steps (Yang et al., 2024, section 3), each a method of
    :class:`~pyro_bdl.inference.LaplaceGuide`:

    1. the curvature at the fine-tuned weights as they are (post hoc): one pass over
       ``train_loader`` for the K-FAC GGN of every random site (:meth:`LaplaceGuide.fit
       <pyro_bdl.inference.LaplaceGuide.fit>` with ``mode_tolerance=None``: the
       fine-tune's AdamW weight decay is not the model's prior, so the checkpoint is not
       that posterior's mode, and refining it would change the network the method is
       meant to explain);
    2. one prior precision :math:`\delta` per weight tensor maximising the evidence
       :math:`\log p(\mathcal{D} \mid \delta)` (eq. 13), by ``num_steps`` steps of Adam
       on :math:`\log \delta` from the model's own prior
       (:meth:`~pyro_bdl.inference.LaplaceGuide.optimize_prior_precision`);
    3. the link of the linearised predictive (``"mc"``, ``"probit"``, ``"bridge"``) with
       the lowest NLL on ``validation_loader``, never on test data
       (:meth:`~pyro_bdl.inference.LaplaceGuide.select_link`); it becomes the guide's
       :attr:`~pyro_bdl.inference.LaplaceGuide.link`, the default of
       :meth:`~pyro_bdl.inference.LaplaceGuide.predictive`.

    The evidence tunes the prior from where the model's prior starts it: a fan-in-scaled
    prior (:meth:`pyro_bdl.priors.LayerwiseNormal.fan_in`) is Laplace-LoRA's, the one to
    build the model with (``lora_model(..., prior=LayerwiseNormal.fan_in())``);
    :func:`~pyro_bdl.models.lora_model`'s default, ``IIDNormal(0.2)`` (BLoB's), only starts
    the tuning elsewhere. A fine-tune from
    :func:`~pyro_bdl.inference.baselines.map_estimate` goes in as
    ``map=predictor.point()``. This is the
    one Laplace-LoRA recipe of the library: :class:`~pyro_bdl.hf.LaplaceCallback` calls it
    too. The prior precision is always the evidence's, as in the paper, which needs no
    validation data for it (section 3.2); validation data choose only among the links,
    whose merits the paper found to depend on the model (Appendix A: ``"mc"`` best for
    LLaMA2-7B). Without them, pass ``links=("mc",)``, the paper's choice.

    **References**

    1. *Bayesian Low-rank Adaptation for Large Language Models*, A. X. Yang, M. Robeyns,
       X. Wang, L. Aitchison (ICLR 2024)

    Example::

        lora = lora_model("minilm", "classification", num_labels=2,
                          prior=bdl.priors.LayerwiseNormal.fan_in())
        ...                                  # fine-tune lora.peft_model (e.g. a Trainer)
        guide, link, scores = fit_laplace_lora(lora.model, train_loader, num_data, val_loader)
        probs = guide.predictive(test_batch, num_data)       # with the link chosen

    :param callable model: the Pyro model ``model(batch, num_data)``, e.g.
        ``lora_model(...).model``.
    :param train_loader: the training batches (labels observed), read once for the
        curvature and the evidence.
    :param int num_data: :math:`N`, the number of training examples.
    :param validation_loader: held-out batches (labels observed) on which the link is
        chosen; may be None when ``links`` names one link.
    :param map: the fine-tuned values of the random sites (a dict site -> tensor), or
        False for the network's own (the checkpoint it holds); True first moves them to
        the posterior's mode (:meth:`LaplaceGuide.fit
        <pyro_bdl.inference.LaplaceGuide.fit>`'s MAP stage).
    :param curvature: the structure (see :class:`~pyro_bdl.inference.LaplaceGuide`);
        Laplace-LoRA's is ``"kron"``.
    :param int num_steps: Adam steps on the evidence (Laplace-LoRA: 1000).
    :param links: the candidate links; one link is used without a validation pass.
    :param int num_samples: logit draws of the ``"mc"`` link on the validation data.
    :param bool progress: progress bars over the passes (on by default, as in Pyro's
        ``MCMC``: a fit on a real model takes minutes).
    :return: the fitted guide, the link chosen, and the validation NLL of each candidate
        (None when one link was given).
    """
    links = tuple(links)
    if not links:
        raise ValueError("links must name at least one of ('mc', 'probit', 'bridge')")
    for name in links:
        one_of("links", name, LINKS)
    if validation_loader is None and len(links) > 1:
        raise ValueError(
            f"fit_laplace_lora chooses the link among {links} on validation data: pass "
            "validation_loader (held-out batches with labels), or links=('mc',) for one link"
        )
    guide = LaplaceGuide(model, curvature=curvature)
    guide.fit(train_loader, num_data, map=map, mode_tolerance=None, progress=progress)
    guide.optimize_prior_precision("marglik", num_steps=num_steps, progress=progress)
    if len(links) == 1:
        guide.link = links[0]
        return guide, guide.link, None
    link, scores = guide.select_link(
        validation_loader, num_data, links=links, num_samples=num_samples, progress=progress
    )
    return guide, link, scores
