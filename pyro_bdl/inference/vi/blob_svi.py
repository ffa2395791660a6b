r"""BLoB's training recipe: two optimisers and re-weighted KL (Table 4, Appendix B.1).

The reference implementation of BLoB takes one minibatch step in two parts:

1. the mean NLL :math:`\ell = -\frac{1}{B}\sum_{n \in \mathcal{D}_i} \log P(y_n \mid A, B)`
   with one flipout draw of A; AdamW updates the means :math:`M`, the B matrices and
   every other point weight with :math:`\nabla \ell`;
2. the weighted KL :math:`\lambda_i \mathrm{KL}` (eq. 11) at the updated means; plain SGD
   at a separate learning rate updates :math:`M` with :math:`\lambda_i \nabla_M
   \mathrm{KL}` and :math:`G` with :math:`\nabla_G \ell + \lambda_i \nabla_G \mathrm{KL}`.

Both learning rates warm up linearly over ``warmup_ratio`` of the steps and then decay
linearly to zero. Relative to the minibatch ELBO (likelihood scaled by :math:`N/B`, KL
weight 1 per epoch) this objective weighs the KL :math:`B` times more per epoch, as the
reference code does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pyro
import torch
from pyro import poutine
from pyro.distributions.util import scale_and_mask
from pyro.poutine.util import site_is_subsample
from torch.distributions import kl_divergence
from tqdm.auto import trange

from pyro_bdl import distributed
from pyro_bdl.inference.minibatch import Minibatches
from pyro_bdl.inference.vi.kl_weights import (
    blob_kl_cycle,
    exponential_kl_weight,
    uniform_kl_weight,
)
from pyro_bdl.inference.vi.mean_field import MeanFieldGuide

__all__ = ["BLoBSVI", "fit_blob"]

# AdamW's epsilon in the reference implementation.
_ADAM_EPS = 1e-6
_KL_WEIGHTINGS = {"exponential": exponential_kl_weight, "uniform": uniform_kl_weight}


class BLoBSVI:
    r"""One BLoB training step at a time, with the reference two-optimiser scheme.

    Like :class:`pyro.infer.SVI`, :meth:`step` takes the model's arguments for one
    minibatch. The KL weight of step :math:`t` is :math:`\lambda_t` of
    :func:`~pyro_bdl.inference.vi.kl_weights.exponential_kl_weight` over a cycle of
    :func:`~pyro_bdl.inference.vi.kl_weights.blob_kl_cycle` minibatches, or :math:`1/M`
    with :math:`M` the minibatches per epoch (``kl_weighting="uniform"``).

    **References**

    [1] Y. Wang et al., "BLoB", NeurIPS 2024: Algorithm 1, Appendix B.1, Tables 3 and 4;
        and its reference code (``modelwrappers/blob.py`` of Wang-ML-Lab/bayesian-peft).

    Example::

        guide = BLoBGuide(model, net, prior_std=0.2)
        svi = BLoBSVI(model, guide, num_steps=5000, lr=5e-4, kl_lr=0.002)
        for batch in batches:
            svi.step(batch, num_data)

    :param callable model: a Pyro model with a ``bdl.observe`` likelihood.
    :param MeanFieldGuide guide: a :class:`~pyro_bdl.inference.BLoBGuide` (any
        :class:`~pyro_bdl.inference.MeanFieldGuide` works: the recipe is then BBB's).
    :param int num_steps: the length of the run (for the learning-rate schedule).
    :param float lr: AdamW's learning rate (Table 3: 5e-4 RoBERTa, 1e-4 Llama2).
    :param float kl_lr: SGD's learning rate for the KL (Table 4: 0.002 RoBERTa, 0.01 Llama2).
    :param float weight_decay: AdamW's decoupled weight decay.
    :param float warmup_ratio: fraction of the steps of linear warm-up (Table 3: 0.06).
    :param str kl_weighting: ``"exponential"`` (BLoB) or ``"uniform"`` (:math:`1/M`).
    :param float gamma: :math:`\gamma` of the dataset rescaling (Table 4: 8).
    """

    def __init__(
        self,
        model: Callable,
        guide: MeanFieldGuide,
        *,
        num_steps: int,
        lr: float = 5e-4,
        kl_lr: float = 0.002,
        weight_decay: float = 0.0,
        warmup_ratio: float = 0.06,
        kl_weighting: str = "exponential",
        gamma: float = 8.0,
    ):
        if not isinstance(guide, MeanFieldGuide):
            raise TypeError(
                f"BLoBSVI: guide must be a BLoBGuide or MeanFieldGuide, got {type(guide).__name__}"
            )
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"BLoBSVI: num_steps must be a positive int, got {num_steps!r}")
        for name, value in (("lr", lr), ("kl_lr", kl_lr), ("weight_decay", weight_decay)):
            if not value >= 0:
                raise ValueError(f"BLoBSVI: {name} must be >= 0, got {value!r}")
        if not gamma > 0:
            raise ValueError(f"BLoBSVI: gamma must be positive, got {gamma!r}")
        if not 0 <= warmup_ratio < 1:
            raise ValueError(f"BLoBSVI: warmup_ratio must be in [0, 1), got {warmup_ratio!r}")
        if kl_weighting not in _KL_WEIGHTINGS:
            raise ValueError(
                f"BLoBSVI: kl_weighting must be one of {sorted(_KL_WEIGHTINGS)}, "
                f"got {kl_weighting!r}"
            )
        self.model = model
        self.guide = guide
        self.num_steps = num_steps
        self.lr = lr
        self.kl_lr = kl_lr
        self.weight_decay = weight_decay
        self.warmup_ratio = warmup_ratio
        self.kl_weighting = kl_weighting
        self.gamma = gamma
        self.step_count = 0
        self.num_data: int | None = None
        self.kl_cycle: int | None = None
        self._optimizers: tuple[torch.optim.Optimizer, torch.optim.Optimizer] | None = None
        self._schedulers: list[torch.optim.lr_scheduler.LambdaLR] = []

    def step(self, *args, **kwargs) -> dict[str, float]:
        """Take one step on the minibatch that ``args`` and ``kwargs`` hold.

        :return: the step's mean NLL, its KL and its KL weight.
        """
        guide_trace = poutine.trace(self.guide).get_trace(*args, **kwargs)
        model_trace = poutine.trace(poutine.replay(self.model, trace=guide_trace)).get_trace(
            *args, **kwargs
        )
        if self._optimizers is None:
            self._setup(guide_trace, model_trace)
        likelihood_optimizer, kl_optimizer = self._optimizers

        nll = -_log_likelihood(model_trace) / self.num_data
        nll.backward()
        likelihood_optimizer.step()
        # G is not AdamW's: it keeps its NLL gradient for the SGD step below.
        likelihood_optimizer.zero_grad(set_to_none=True)

        kl = self._kl(model_trace)
        kl_weight = _KL_WEIGHTINGS[self.kl_weighting](self.step_count, self.kl_cycle)
        (kl_weight * kl).backward()
        kl_optimizer.step()
        kl_optimizer.zero_grad(set_to_none=True)

        for scheduler in self._schedulers:
            scheduler.step()
        self.step_count += 1
        return {"nll": nll.item(), "kl": kl.item(), "kl_weight": kl_weight}

    def _setup(self, guide_trace: pyro.poutine.Trace, model_trace: pyro.poutine.Trace) -> None:
        self.num_data, batch_size = _data_sizes(model_trace)
        if self.kl_weighting == "exponential":
            self.kl_cycle = blob_kl_cycle(self.num_data, batch_size, self.gamma)
        else:
            self.kl_cycle = math.ceil(self.num_data / batch_size)
        locs, scale_params = self.guide.variational_parameters()
        guide_params = {name for name, site in guide_trace.nodes.items() if site["type"] == "param"}
        point_weights = [
            site["value"].unconstrained()
            for name, site in model_trace.nodes.items()
            if site["type"] == "param" and name not in guide_params
        ]
        likelihood_optimizer = torch.optim.AdamW(
            [*locs.values(), *point_weights],
            lr=self.lr,
            eps=_ADAM_EPS,
            weight_decay=self.weight_decay,
        )
        kl_optimizer = torch.optim.SGD([*locs.values(), *scale_params.values()], lr=self.kl_lr)
        # data-parallel (torchrun): both optimisers average their gradients across ranks
        self._optimizers = tuple(
            map(distributed.average_gradients_at_each_step, (likelihood_optimizer, kl_optimizer))
        )
        self._schedulers = [
            torch.optim.lr_scheduler.LambdaLR(optimizer, self._schedule)
            for optimizer in self._optimizers
        ]
        for optimizer in self._optimizers:
            optimizer.zero_grad(set_to_none=True)

    def _schedule(self, step: int) -> float:
        # Linear warm-up then linear decay to 0, as transformers' get_linear_schedule_with_warmup.
        warmup = self.num_steps * self.warmup_ratio
        if step < warmup:
            return step / max(1.0, warmup)
        return max(0.0, (self.num_steps - step) / max(1.0, self.num_steps - warmup))

    def _kl(self, model_trace: pyro.poutine.Trace) -> torch.Tensor:
        kl = 0.0
        for name in self.guide.site_names:
            prior = model_trace.nodes[name]["fn"]
            try:
                kl = kl + kl_divergence(self.guide.get_posterior(name), prior).sum()
            except NotImplementedError:
                raise ValueError(
                    f"BLoBSVI: the prior of {name!r} is a {type(prior).__name__}, which has no "
                    "closed-form KL from a Normal; BLoB's eq. 11 needs a Normal prior "
                    "(e.g. bdl.priors.IIDNormal)"
                ) from None
        return kl


def fit_blob(
    model: Callable,
    guide: MeanFieldGuide,
    *args,
    num_steps: int,
    lr: float = 5e-4,
    kl_lr: float = 0.002,
    weight_decay: float = 0.0,
    warmup_ratio: float = 0.06,
    kl_weighting: str = "exponential",
    gamma: float = 8.0,
    progress: bool = True,
    **kwargs,
) -> dict[str, list[float]]:
    """Train a BLoB guide with the reference recipe on minibatches (see :class:`BLoBSVI`).

    DataLoader arguments are replaced by a fresh minibatch at every step.

    Example::

        guide = BLoBGuide(model, net, prior_std=0.2)
        history = fit_blob(model, guide, train_loader, len(train_set), num_steps=5000)

    :param callable model: a Pyro model with a ``bdl.observe`` likelihood.
    :param guide: a :class:`~pyro_bdl.inference.BLoBGuide`.
    :param args: the model's arguments (DataLoaders stand for minibatches).
    :param int num_steps: training steps.
    :param bool progress: show a progress bar.
    :return: per step, the mean NLL (``"nll"``), the KL (``"kl"``) and its weight
        (``"kl_weight"``).

    The other parameters are :class:`BLoBSVI`'s.
    """
    svi = BLoBSVI(
        model,
        guide,
        num_steps=num_steps,
        lr=lr,
        kl_lr=kl_lr,
        weight_decay=weight_decay,
        warmup_ratio=warmup_ratio,
        kl_weighting=kl_weighting,
        gamma=gamma,
    )
    batches = Minibatches(args, kwargs)
    history: dict[str, list[float]] = {"nll": [], "kl": [], "kl_weight": []}
    bar = trange(num_steps, desc="BLoB", disable=not progress, leave=False)
    for _ in bar:
        step_args, step_kwargs = batches.next()
        for key, value in svi.step(*step_args, **step_kwargs).items():
            history[key].append(value)
        bar.set_postfix(
            nll=f"{history['nll'][-1]:.4g}", kl=f"{history['kl'][-1]:.4g}", refresh=False
        )
    return history


def _observed_sites(trace: pyro.poutine.Trace) -> list[dict]:
    return [
        site
        for site in trace.nodes.values()
        if site["type"] == "sample" and site["is_observed"] and not site_is_subsample(site)
    ]


def _log_likelihood(trace: pyro.poutine.Trace) -> torch.Tensor:
    """The minibatch log likelihood, scaled by N / B as ``bdl.observe`` asks."""
    total = 0.0
    for site in _observed_sites(trace):
        log_prob = site["fn"].log_prob(site["value"], *site["args"], **site["kwargs"])
        total = total + scale_and_mask(log_prob, site["scale"], site["mask"]).sum()
    if not torch.is_tensor(total):
        raise ValueError(
            "BLoBSVI: the model observes nothing; BLoB trains on a likelihood "
            "(bdl.observe(name, distribution, obs=labels, num_data=N))"
        )
    return total


def _data_sizes(trace: pyro.poutine.Trace) -> tuple[int, int]:
    """The data-set size N and the minibatch size B of the observed plate."""
    for site in _observed_sites(trace):
        for frame in site["cond_indep_stack"]:
            if frame.full_size:
                return frame.full_size, frame.size
    raise ValueError(
        "BLoBSVI: found no minibatch plate around the observations; observe the labels with "
        "bdl.observe(name, distribution, obs, num_data=N) so that N and the batch size are known"
    )
