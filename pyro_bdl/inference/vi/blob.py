r"""BLoB: Bayesian low-rank adaptation by backpropagation (Wang et al., 2024).

Asymmetric LoRA Bayesianisation (section 3.1): each LoRA A matrix gets
:math:`q(A) = \mathcal{N}(M, \Omega^2)` elementwise with :math:`\Omega = G^2` (section 3.3),
each B is a point estimate, and the prior is :math:`P(A) = \mathcal{N}(0, \sigma_p^2)`, so
that the KL of the full weights reduces to that of A (Theorem 3.2, eq. 11):

.. math::

    \mathrm{KL}[q(A) \,\|\, P(A)] = \frac{1}{2\sigma_p^2}\big(\|M\|_2^2 + \|\Omega\|_2^2\big)
        - \sum_{ij} \log \Omega_{ij} + \text{const}.

Minibatch examples see independent perturbations of A through flipout (eq. 12, see
:mod:`~pyro_bdl.inference.vi.flipout`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch

from pyro_bdl._checks import function, instance, real
from pyro_bdl.inference.vi.flipout import LoRAFlipout
from pyro_bdl.inference.vi.mean_field import MeanFieldGuide
from pyro_bdl.lift import LiftedModule, init_to_module, recording_calls
from pyro_bdl.priors import IIDNormal

__all__ = ["BLoBGuide"]


class BLoBGuide(MeanFieldGuide):
    r"""The BLoB variational posterior of the LoRA A matrices of a lifted peft model.

    The network must be lifted with the LoRA A weights random and the LoRA B weights
    point estimates (a ``pyro.param``, initialised to the module's B: zero for a fresh
    adapter), so that B gets no KL and no noise::

        net = bdl.lift(peft_model, prior=bdl.priors.IIDNormal(0.2), random="lora_A",
                       point=lambda name, p: "lora_B" in name or "classifier" in name)

    Per A: :math:`M` starts at the module's A (LoRA's own initialisation) and :math:`G` at
    :math:`\mathcal{U}[\epsilon/\sqrt{2}, \epsilon]` (Algorithm 1, Appendix B.1); draws are
    :math:`A = M + G^2 \circ E`. With ``flipout`` every forward of the model with a draw of
    this guide (``SVI`` and :class:`~pyro_bdl.inference.BLoBSVI` steps,
    :func:`~pyro_bdl.predict.predict_proba` with the guide, a replay of its trace) computes
    eq. 12 at the A projections, with one noise matrix :math:`E` per forward and random
    signs per example (per token for sequences). Pyro's ``Predictive`` runs the model on
    copies of the draws: there a batch shares one draw per sample, which leaves every
    example's predictive distribution the same.

    The KL is the closed form of eq. 11 under ``TraceMeanField_ELBO``; the paper's training
    recipe (two optimisers, KL re-weighting) is :func:`~pyro_bdl.inference.fit_blob`.
    ``guide.median()`` is the mean weights, "BLoB (N=0)".

    .. note:: The flipout hooks sit on the peft model's LoRA A layers while the guide is
        alive and ``flipout`` is on, and act only on forwards whose A is this guide's
        latest draw: other inference on the same peft model is left alone.

    **References**

    [1] Y. Wang, H. Shi, L. Han, D. Metaxas, H. Wang, "BLoB: Bayesian Low-Rank Adaptation by
    Backpropagation for Large Language Models", NeurIPS 2024.
    [2] Y. Wen et al., "Flipout: efficient pseudo-independent weight perturbations on
    mini-batches", ICLR 2018.

    Example::

        guide = BLoBGuide(model, eps=0.05, prior_std=0.2)
        fit_blob(model, guide, train_loader, len(train_set), num_steps=5000)
        probs = predict_proba(model, batch, num_data, guide=guide, num_samples=10)

    :param callable model: the Pyro model; it calls one or more lifted networks.
    :param LiftedModule net: the lifted peft model. By default ``model.net`` (as
        :class:`~pyro_bdl.models.BayesianNet` has it), or else the lifted networks the
        model calls, found at the guide's first call (its prototype trace).
    :param float eps: :math:`\epsilon` of the initialisation of :math:`G` (Table 4: 0.05).
    :param float prior_std: :math:`\sigma_p`; if given, the network's prior becomes
        ``IIDNormal(prior_std)`` (Table 4: 0.2 for RoBERTa, 2 for Llama2); by default the
        network keeps its prior (any Normal gives a closed-form KL).
    :param bool flipout: flipout at the A projections (eq. 12).
    :param callable init_loc_fn: where :math:`M` starts (default: the module's A).
    """

    def __init__(
        self,
        model: Callable,
        net: LiftedModule | None = None,
        *,
        eps: float = 0.05,
        prior_std: float | None = None,
        flipout: bool = True,
        init_loc_fn: Callable = init_to_module,
    ):
        function("model", model, "a Pyro model (a callable)")
        if net is None and isinstance(getattr(model, "net", None), LiftedModule):
            net = model.net
        if net is not None:
            instance("net", net, LiftedModule, "a LiftedModule made by bdl.lift (or None)")
        self.eps = real("eps", eps, positive=True)
        self.prior_std = None if prior_std is None else real("prior_std", prior_std, positive=True)
        self._flipout_on = instance("flipout", flipout, bool, "True or False")
        self._flipouts: list[LoRAFlipout] = []
        self._nets: list[LiftedModule] = []
        super().__init__(
            model, init_loc_fn=init_loc_fn, init_scale=self.eps, scale_parametrization="square"
        )
        if net is not None:
            self._use(net)
        # The hooks leave with the guide (a list, so that the finaliser holds no guide).
        weakref.finalize(self, _detach_all, self._flipouts)

    def _use(self, *nets: LiftedModule) -> None:
        """Adopt the lifted networks: check the design, set the prior, hook flipout."""
        for net in nets:
            _check_asymmetric(net)
        for net in nets:
            if self.prior_std is not None:
                net.prior = IIDNormal(self.prior_std)
            self._nets.append(net)
            self._flipouts.append(LoRAFlipout(net, net.random_sites))
        self.flipout = self._flipout_on

    def _setup_prototype(self, *args, **kwargs) -> None:
        if self._nets:
            super()._setup_prototype(*args, **kwargs)
        else:
            with recording_calls() as called:
                super()._setup_prototype(*args, **kwargs)
            if not called:
                raise TypeError(
                    "BLoBGuide: the model called no network made by bdl.lift; lift the peft "
                    "model (bdl.lift(peft_model, random='lora_A', point='lora_B')) or pass "
                    "net=<it>"
                )
            self._use(*called)
        adapters = {site for net in self._nets for site in net.random_sites}
        others = [name for name in self.sites if name not in adapters]
        if others:
            raise ValueError(
                f"BLoBGuide: the model's latent site {others[0]!r} is not a LoRA A matrix of "
                "the lifted network; BLoB puts its posterior on LoRA A only (section 3.1): "
                "make it a point weight (pyro.param), or use MeanFieldGuide for the whole model"
            )

    @property
    def flipout(self) -> bool:
        """Whether flipout runs at the A projections; assign to switch it."""
        return self._flipout_on

    @flipout.setter
    def flipout(self, enabled: bool) -> None:
        self._flipout_on = instance("flipout", enabled, bool, "True or False")
        for flipout in self._flipouts:
            if enabled:
                flipout.attach()
            else:
                flipout.detach()

    def _init_scale_param(self, init_loc: torch.Tensor) -> torch.Tensor:
        # G ~ U[eps / sqrt(2), eps] (Algorithm 1, line 1), so Omega = G^2 starts in
        # [eps^2 / 2, eps^2].
        low = self.eps / math.sqrt(2)
        return torch.empty_like(init_loc).uniform_(low, self.eps)

    def draw(self):
        draws, locs, scales = super().draw()
        for flipout in self._flipouts:  # the forwards with these draws get flipout
            flipout.record(draws, locs)
        return draws, locs, scales

    def hyperparameters(self) -> dict:
        return {"eps": self.eps, "prior_std": self.prior_std, "flipout": self.flipout}


def _detach_all(flipouts: list[LoRAFlipout]) -> None:
    for flipout in flipouts:
        flipout.detach()


def _check_asymmetric(net: LiftedModule) -> None:
    random = sorted(net.random_sites.values())
    point = set(net.point_sites.values())
    # BLoB's layout in the vocabulary of the call that made the network
    from_lora_model = net.made_by == "lora_model"
    layout = "build it with lora_model(..., adapters_random='A', head='point')"
    fix_b = layout if from_lora_model else "lift it with point='lora_B'"
    fix_a = layout if from_lora_model else "lift with random='lora_A'"
    random_b = [name for name in random if "lora_B" in name]
    if random_b:
        raise ValueError(
            f"BLoBGuide: {random_b[0]!r} is random; BLoB keeps B a point estimate with no KL "
            f"and no noise (section 3.1): {fix_b}"
        )
    for name in random:
        if "lora_A" not in name:
            raise ValueError(
                f"BLoBGuide: the random weight {name!r} is not a LoRA A matrix; BLoB puts a "
                f"posterior on LoRA A only (section 3.1): {fix_a}"
            )
        b_name = name.replace("lora_A", "lora_B")
        if b_name not in point:
            raise ValueError(
                f"BLoBGuide: the LoRA B matrix {b_name!r} beside {name!r} is not lifted, so it "
                "would never be trained: lift it as a point weight (point='lora_B')"
            )
