r"""The Laplace approximation as a Pyro guide.

:class:`LaplaceGuide` turns a MAP fit into the Gaussian
:math:`q(\theta) = \mathcal{N}(\theta_\text{MAP}, T P^{-1})` over the latent sites of a
Pyro model (the weights :func:`pyro_bdl.lift` makes random, or plain ``pyro.sample``
sites with normal priors), with :math:`P = H + \operatorname{diag}(\delta)`: :math:`H` a
curvature of the log likelihood at the MAP (diagonal, K-FAC, low-rank K-FAC or dense;
GGN or Fisher), :math:`\delta` the prior precision and :math:`T` the temperature
(posteriors paper, section 2 and Appendix A.1; Laplace-LoRA, section 3.2).

It is an :class:`~pyro.infer.autoguide.AutoGuide`: calling it draws every site from
:math:`q`, so ``Predictive(model, guide=guide, num_samples=S)`` gives the sampled-weights
predictive and ``bdl.to_arviz(guide, num_samples=S)`` exports draws. The linearised
predictive, the evidence, prior-precision tuning and the posterior-as-prior live here as
methods. ``bdl.save(guide, directory)`` keeps a fitted guide and ``bdl.load(directory,
model)`` gives it back in another process (:mod:`pyro_bdl.persistence`).

On a model without the per-example structure those curvatures need (a constrained
site, a hierarchical prior, a latent scale of the likelihood, several likelihoods, see
:mod:`~pyro_bdl.inference.laplace.hessian`), ``curvature="full"`` is the exact Hessian
of the log joint in the unconstrained space, as Pyro's ``AutoLaplaceApproximation``
computes it, and the other curvatures refuse the model, naming what is missing.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from contextlib import ExitStack

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions.util import scale_and_mask
from pyro.infer.autoguide import AutoGuide
from pyro.infer.autoguide.initialization import InitMessenger
from tqdm.auto import tqdm

from pyro_bdl import distributed
from pyro_bdl._checks import function, instance, integer, one_of, real, site_keys
from pyro_bdl._draws import kept_draws
from pyro_bdl.inference.guide_state import GuideState, dtype_name
from pyro_bdl.inference.laplace.curvature import Curvature, Full, make_curvature
from pyro_bdl.inference.laplace.evidence import log_marginal_likelihood, maximise_evidence
from pyro_bdl.inference.laplace.hessian import HessianBlock, LogJointPass
from pyro_bdl.inference.laplace.jacobians import DenseGradient, ModelJacobians
from pyro_bdl.inference.laplace.observation import StructureError
from pyro_bdl.inference.laplace.predictive import (
    LINKS,
    laplace_bridge,
    mc_probabilities,
    probit,
)
from pyro_bdl.inference.laplace.prior import LaplacePrior
from pyro_bdl.inference.laplace.state import (
    curvature_from_settings,
    laplace_state,
    restore_laplace,
)
from pyro_bdl.inference.map import adam_at_prior_scale, minimise
from pyro_bdl.inference.minibatch import DataPass, Minibatches
from pyro_bdl.inference.sites import LatentSites
from pyro_bdl.lift import init_to_module
from pyro_bdl.priors import normal_parameters

__all__ = ["LaplaceGuide"]

# L-BFGS passes before the curvature is first refreshed; each round doubles it (a
# fresh curvature whitens far better while the point still moves a lot).
_FIRST_ROUND = 5

PriorPrecision = float | Mapping[str, float | torch.Tensor] | None


class LaplaceGuide(GuideState, AutoGuide):
    r"""Laplace approximation :math:`\mathcal{N}(\theta_\text{MAP}, T P^{-1})` of a model's weights.

    :meth:`fit` finds the MAP (Adam on minibatches, then L-BFGS on full passes to a
    tolerance it checks; or takes given values, which it checks too) and makes one pass
    over the DataLoader arguments to accumulate the curvature :math:`H`, the sum over the
    data set of :math:`J_i^\top V_i V_i^\top J_i`
    (see :mod:`~pyro_bdl.inference.laplace.curvature`). The posterior precision is

    .. math:: P = H + \operatorname{diag}(\delta), \qquad \Sigma = T P^{-1},

    with :math:`\delta = 1/\sigma^2` from the model's normal priors unless
    ``prior_precision`` overrides it. A prior that is not a Normal (real support, fixed,
    entry by entry independent, e.g. a ``Logistic``) contributes its own curvature
    :math:`-\partial^2 \log p(\theta) / \partial\theta^2` at the mode in place of
    :math:`\delta`, which only K-FAC, needing one precision per layer, refuses.
    :math:`T` tempers the whole posterior, :math:`p(\theta \mid \mathcal{D})^{1/T}`, as the
    SGMCMC kernels do.

    Curvatures: ``"diag_ggn"``, ``"diag_ef"``, ``"kron"`` (K-FAC per linear layer, the
    default, as in Laplace-LoRA), ``"kron_lowrank"`` (rank-16 large factors) and
    ``"full"``; or an instance such as ``KronLowRank(rank=8)`` or ``Kron(fisher="mc")``.

    **References**

    - A. X. Yang, M. Robeyns, X. Wang, L. Aitchison, *Bayesian low-rank adaptation for
      large language models*, ICLR 2024.
    - E. Daxberger et al., *Laplace redux: effortless Bayesian deep learning*, NeurIPS 2021.
    - S. Duffield et al., *Scalable Bayesian learning with posteriors*, ICLR 2025.

    Example::

        net = bdl.lift(peft_model, prior=bdl.priors.IIDNormal(0.2))   # adapters and head
        net.module.eval()                        # no dropout in the curvature pass

        def model(batch, num_data):
            logits = net(input_ids=batch["input_ids"],
                         attention_mask=batch["attention_mask"]).logits
            bdl.observe("y", dist.Categorical(logits=logits), batch.get("labels"), num_data)
            return logits

        guide = LaplaceGuide(model, curvature="kron")
        guide.fit(train_loader, len(train_set), map=False)   # a fine-tuned checkpoint
        guide.optimize_prior_precision("marglik")
        probs = guide.predictive(test_batch, len(train_set), link="mc")
        draws = Predictive(model, guide=guide, num_samples=20)(test_batch, len(train_set))

    :param callable model: a Pyro model: for the GGN and Fisher curvatures, one observed
        site (``bdl.observe``, or ``pyro.sample(..., obs=...)`` of a supported likelihood,
        in any plate, subsampled or not) and real latent sites with fixed priors; for
        ``"full"`` any model whose latent sites are global (see the module docstring).
    :param curvature: a curvature name or :class:`Curvature` instance.
    :param prior_precision: :math:`\delta`: None (from the model's priors), one positive
        number for every site, or a dict site -> number or tensor (others from the priors).
    :param float temperature: :math:`T > 0`.
    :param callable init_loc_fn: where the MAP search starts and, with ``map=False``, the
        values kept (default: the module's weights for lifted sites).
    """

    def __init__(
        self,
        model: Callable,
        curvature: str | Curvature = "kron",
        *,
        prior_precision: PriorPrecision = None,
        temperature: float = 1.0,
        init_loc_fn: Callable = init_to_module,
    ):
        function("model", model, "a Pyro model (a callable)")
        if not isinstance(curvature, (str, Curvature)):
            raise TypeError(
                "curvature must be a name such as 'kron' or a Curvature instance such as "
                f"KronLowRank(rank=8), got {type(curvature).__name__}"
            )
        temperature = real("temperature", temperature, positive=True)
        function("init_loc_fn", init_loc_fn, "a Pyro init strategy (site -> value)")
        prior_precision = _checked_precision(prior_precision)
        curvature = make_curvature(curvature)
        super().__init__(InitMessenger(init_loc_fn)(model))
        self._laplace_model = (model,)  # a tuple keeps nn.Module from registering it
        self.curvature = curvature
        self.temperature = temperature
        self.init_loc_fn = init_loc_fn
        self._prior_precision_arg = prior_precision
        self._blocks = None
        #: the link :meth:`predictive` uses by default: ``"mc"``, or what :meth:`select_link`
        #: chose (saved with the guide)
        self.link = "mc"
        #: why the exact Hessian of the log joint is used (None: the curvature's structure)
        self.exact_hessian_reason: str | None = None

    # -- fitting ---------------------------------------------------------------------

    def fit(
        self,
        *args,
        map: bool | Mapping[str, torch.Tensor] = True,
        num_steps: int = 1000,
        optimizer: pyro.optim.PyroOptim | None = None,
        max_passes: int = 100,
        mode_tolerance: float | None = 0.1,
        progress: bool = True,
        **kwargs,
    ) -> LaplaceGuide:
        r"""Find the MAP, then accumulate the curvature in one pass over the data.

        With ``map=True`` the mode is found in two stages. First ``num_steps`` minibatch
        steps of ``optimizer`` on the log joint, by default Adam with a learning rate of
        1% of each site's prior standard deviation (Adam moves every coordinate by about
        its learning rate per step, and the prior's scale is the scale the weights live
        on). Then L-BFGS on the log joint over full passes of the data, in coordinates
        whitened by the Laplace covariance at its start, :math:`\theta = \theta_0 + R u`
        with :math:`R R^\top = P^{-1}`: there the problem is close to the identity and the
        gradient's norm is the Newton decrement below. L-BFGS stops when that is under
        ``mode_tolerance / 2``; the curvature is then taken afresh at the new point, and
        the two alternate (5, 10, 20, ... passes per round) while the point is not within
        ``mode_tolerance`` and fewer than ``max_passes`` passes have been made.

        Whatever the values (found, ``map=False`` or a dict), the curvature pass also
        takes the gradient :math:`g` of the log joint over the data, and the fit reports

        .. math:: \lambda = \sqrt{g^\top P^{-1} g / T}

        (:attr:`mode_distance`): the distance from the point to the mode of the quadratic
        model of the tempered log posterior, in its own standard deviations (the Newton
        decrement). By Cauchy-Schwarz it bounds how far any linear function of the
        weights (a linearised prediction, a coordinate of the mean) is off, in posterior
        standard deviations, and the evidence is about :math:`\lambda^2 / 2` nats low.
        Above ``mode_tolerance`` the fit warns: the approximation is not centred on a
        mode, and its mean, curvature and evidence are those of another point.

        .. note:: At a LoRA initialisation (``B = 0``) the prior pulls ``A`` to zero
            while the likelihood gives it no gradient; on little data the mode may be
            ``A = B = 0`` (no fine-tuning), which is then what this finds. To Laplace a
            fine-tuned adapter, pass its values (``map=``) or ``map=False``.

        :param args: the model's arguments; a DataLoader stands for its batches.
        :param map: True: find the MAP (above); False: take the current values (a
            fine-tuned checkpoint) as the MAP; a dict: these site values.
        :param int num_steps: minibatch steps before L-BFGS (0 starts L-BFGS from the
            initial values, e.g. to refine a checkpoint to its mode).
        :param optimizer: a ``pyro.optim`` optimiser for those steps.
        :param int max_passes: the most full passes of the data L-BFGS may make.
        :param float mode_tolerance: the largest :math:`\lambda` accepted, in posterior
            standard deviations; None skips the check and the gradient it needs (one
            backward pass per batch) and, with ``map=True``, the L-BFGS stage, which stops
            on it.
        :param bool progress: show progress bars.
        :return: the guide, fitted.
        """
        if not isinstance(map, (bool, Mapping)):
            raise TypeError(
                f"map must be True, False or a dict of site values, got {type(map).__name__}"
            )
        num_steps = integer("num_steps", num_steps, low=0)
        max_passes = integer("max_passes", max_passes, low=0)
        if mode_tolerance is not None:
            mode_tolerance = real("mode_tolerance", mode_tolerance, positive=True)
        instance("progress", progress, bool, "True or False")
        if optimizer is not None:
            instance("optimizer", optimizer, pyro.optim.PyroOptim, "a pyro.optim optimiser")
        model = self._laplace_model[0]
        batches = DataPass(model, args, kwargs)
        first_args, first_kwargs = batches.batches.peek()
        self._setup_prototype(*first_args, **first_kwargs)
        if map is True:
            self._probe_structure(model, first_args, first_kwargs)
            values, _ = minimise(
                model,
                args,
                kwargs,
                num_steps,
                optimizer or adam_at_prior_scale(self._prior_scales()),
                False,
                self.init_loc_fn,
                progress,
                jacobian=True,
            )
        elif map is False:
            values = {name: site.message["value"] for name, site in self.sites.items()}
        else:
            values = self._checked_values(map)
        values = {name: value.detach() for name, value in values.items()}
        self._loc = {name: z.clone() for name, z in self.sites.unconstrain(values).items()}
        check = mode_tolerance is not None
        self._accumulate(model, batches, progress, gradient=check)
        passes = rounds = 0
        distance = self._mode_distance() if check else 0.0
        while check and map is True and passes < max_passes and distance > mode_tolerance:
            budget = min(max_passes - passes, _FIRST_ROUND * 2**rounds)
            rounds += 1
            before = self._loc
            passes += self._refine(model, batches, mode_tolerance, budget, progress)
            # A round whose line search found no decrease has met the precision of the log
            # joint itself: more rounds cannot bring the mode closer.
            if all(torch.equal(before[name], value) for name, value in self._loc.items()):
                break
            self._accumulate(model, batches, progress, gradient=True)
            distance = self._mode_distance()
        if check and distance > mode_tolerance:
            self._warn_not_a_mode(map, mode_tolerance, num_steps, max_passes)
        _warn_if_adapters_untrained(self._loc)
        if self.exact_hessian_reason is not None:
            _check_positive_definite(self._blocks[0], self.exact_hessian_reason)
        return self

    def _prior_scales(self) -> dict[str, float]:
        """The scale each site's unconstrained value lives on: a Normal prior's standard
        deviation, 1 for any other prior (the scale of the unconstrained space)."""
        scales = {}
        for name, site in self.sites.items():
            normal = normal_parameters(site.message["fn"], site.message["value"])
            scales[name] = 1.0 if normal is None or not site.is_real else float(normal[1].mean())
        return scales

    def _checked_values(self, values: Mapping) -> dict[str, torch.Tensor]:
        """``fit(map=values)``: one finite tensor per latent site, of the site's shape."""
        site_keys("fit(map=...)", values, self.sites, "the model's latent sites")
        missing = [name for name in self.sites if name not in values]
        if missing:
            raise ValueError(f"fit(map=...): no value for the latent sites {missing[:5]}")
        checked = {}
        for name, site in self.sites.items():
            like = site.message["value"]
            value = values[name]
            if not torch.is_tensor(value):
                raise TypeError(
                    f"fit(map=...): the value of {name!r} must be a tensor, got "
                    f"{type(value).__name__}"
                )
            if value.shape != like.shape:
                raise ValueError(
                    f"fit(map=...): the value of {name!r} has shape {tuple(value.shape)}, the "
                    f"site has shape {tuple(like.shape)}"
                )
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"fit(map=...): the value of {name!r} is not finite")
            fn = site.message["fn"]
            if not bool(fn.support.check(value).all()):
                raise ValueError(
                    f"fit(map=...): the value of {name!r} is outside the site's support "
                    f"{fn.support}"
                )
            checked[name] = value.to(dtype=like.dtype, device=like.device)
        return checked

    def _setup_prototype(self, *args, **kwargs) -> None:
        super()._setup_prototype(*args, **kwargs)
        self.sites = LatentSites(self.prototype_trace, "LaplaceGuide")
        if not self.sites:
            raise ValueError("LaplaceGuide: the model has no latent sample sites")
        self.sites.refuse_local(
            "the Laplace approximation is over global sites, as Pyro's AutoLaplaceApproximation's"
        )
        fixed = self.sites.fixed_priors(self.model, args, kwargs)
        self.exact_hessian_reason = None
        self._prior_loc, self._model_precision, self._other_priors = {}, {}, {}
        for name, site in self.sites.items():
            reason = _no_structure(name, site, fixed)
            if reason is not None:
                self._use_exact_hessian(reason)
                return
            normal = self.sites.normal_prior(name, fixed) if site.unscaled else None
            if normal is None:  # its curvature by autodiff, at each curvature pass
                self._other_priors[name] = site.message
                continue
            self._prior_loc[name] = normal[0]
            self._model_precision[name] = normal[1].reciprocal().square()
        self._prior_precision = {}
        self.prior_precision = self._prior_precision_arg

    def _use_exact_hessian(self, reason: str) -> None:
        """Take the exact Hessian of the log joint, or refuse the model by name."""
        if not isinstance(self.curvature, Full):
            raise StructureError(
                f"LaplaceGuide(curvature={self.curvature.name!r}): {reason}, so the "
                "per-example structure of the GGN and Fisher curvatures is not there. "
                "curvature='full' takes the exact Hessian of the log joint instead (as "
                "Pyro's AutoLaplaceApproximation), for models of up to "
                f"Full(max_params=...) latent entries"
            )
        if self._prior_precision_arg is not None:
            raise ValueError(
                f"prior_precision: {reason}, so LaplaceGuide takes the exact Hessian of the "
                "model's log joint, prior included; there is no separate prior precision to "
                "set: change the prior's scale in the model"
            )
        size = self.sites.numel
        if size > self.curvature.max_params:
            raise ValueError(
                f"LaplaceGuide: {reason}, so the curvature is the exact Hessian of the log "
                f"joint, a {size} x {size} matrix, more than max_params="
                f"{self.curvature.max_params}; pass Full(max_params=...) if the memory is there"
            )
        self.exact_hessian_reason = reason
        self._prior_loc, self._model_precision, self._other_priors = {}, {}, {}
        self._prior_precision = {}

    def _probe_structure(self, model: Callable, args: tuple, kwargs: dict) -> None:
        """Read the likelihood of one run before a MAP search, so that a model without the
        GGN's structure is refused (or sent to the exact Hessian) before, not after it."""
        if self.exact_hessian_reason is not None:
            return
        values = {name: site.message["value"] for name, site in self.sites.items()}
        try:
            ModelJacobians(model, values)(args, kwargs)
        except StructureError as error:
            self._use_exact_hessian(str(error).removeprefix("LaplaceGuide: "))

    def _accumulate(self, model: Callable, batches: DataPass, progress: bool, gradient: bool):
        """The curvature pass at ``self._loc`` (with the log joint's gradient if asked)."""
        if self.exact_hessian_reason is None:
            try:
                self._accumulate_structured(model, batches, progress, gradient)
                return
            except StructureError as error:  # learnt from the first batch's likelihood
                self._use_exact_hessian(str(error).removeprefix("LaplaceGuide: "))
        self._accumulate_exact(model, batches, progress)

    def _accumulate_structured(self, model, batches, progress, gradient) -> None:
        curvature = self.curvature
        curvature.begin(self._loc)
        self._prior_precision.update(self._prior_curvature(self._loc))
        log_likelihood, score, num_data, seen, jacobians = self._pass(
            model, batches, self._loc, curvature, gradient, progress
        )
        self._blocks = curvature.blocks(num_data / seen)
        self._log_likelihood = log_likelihood
        self.num_data = num_data
        self._jacobians = jacobians
        for block in self._blocks:
            try:
                block.check_prior(self._prior_precision)
            except ValueError as error:
                other = next((name for name in block.sites if name in self._other_priors), None)
                if other is None:
                    raise
                fn = self.sites[other].prior_name
                raise ValueError(
                    f"{error}. The prior of {other!r} is a {fn}, not a Normal: its curvature "
                    "differs from entry to entry, which K-FAC cannot hold; use "
                    "curvature='diag_ggn' or 'full'"
                ) from None
        self._gradient = None if score is None else self._log_joint_gradient(score, self._loc)

    def _accumulate_exact(self, model, batches, progress) -> None:
        """The exact Hessian of the log joint at ``self._loc`` (see :mod:`.hessian`)."""
        log_joint = LogJointPass(model, self.sites, batches)
        value, grad, hessian = log_joint(self.sites.pack(self._loc), order=2, progress=progress)
        shapes = {name: site.unconstrained_shape for name, site in self.sites.items()}
        self._blocks = [HessianBlock(shapes, -hessian)]
        self._log_likelihood = value  # the whole log joint: the evidence's other terms
        self.num_data = log_joint.num_data
        self._jacobians = None
        self._gradient = self.sites.unpack(grad)

    def _prior_curvature(self, values) -> dict[str, torch.Tensor]:
        """:math:`-\\partial^2 \\log p / \\partial\\theta^2` entry by entry, for the priors
        that are not Normal (independent entries: the gradient of the summed first
        derivatives is the diagonal), checked positive."""
        curvatures = {}
        for name, message in self._other_priors.items():
            x = values[name].detach().requires_grad_()
            with torch.enable_grad():
                log_prior = _site_log_density(message, x)
                (grad,) = torch.autograd.grad(log_prior, x, create_graph=True)
                (second,) = torch.autograd.grad(grad.sum(), x, allow_unused=True)
            curvature = torch.zeros_like(x) if second is None else -second.detach()
            if not bool((curvature > 0).all()):
                raise ValueError(
                    f"LaplaceGuide: the log prior of {name!r} ({self.sites[name].prior_name}) "
                    "is not strictly concave at the fitted point (curvature "
                    f"{float(curvature.min()):.3g} somewhere), so the Laplace precision is not "
                    "positive definite there; give the site a log-concave prior"
                )
            curvatures[name] = curvature
        return curvatures

    def _pass(self, model, batches, values, curvature, gradient, progress):
        r"""One pass over the data at ``values``.

        Feeds each batch's per-example gradients to ``curvature`` (if given) and sums the
        log likelihood and, if ``gradient``, its gradient; both are scaled by
        :math:`N / n_\text{seen}`, the one scaling every structure shares (1 after a full
        pass over ``N`` examples).

        :return: (log likelihood, its gradient per site or None, N, the number of
            examples seen, the ModelJacobians).
        """
        jacobians = ModelJacobians(model, values)
        log_likelihood, seen, num_data = 0.0, 0, None
        score = [torch.zeros_like(v) for v in jacobians.values.values()] if gradient else None
        bar = tqdm(
            batches,
            total=batches.runs,
            desc=f"Laplace {curvature.name}" if curvature else "log joint",
            disable=not progress,
            leave=False,
        )
        for args, kwargs, context in bar:
            with context:
                batch_log_likelihood, batch_num_data, examples = self._batch(
                    jacobians, args, kwargs, curvature, score
                )
            if batches.plate is not None:  # a subsample plate's chunk: the indices not seen
                examples = batches.plate.kept
            if num_data is not None and batch_num_data != num_data:
                raise ValueError(
                    f"the observed site's num_data changed between batches ({num_data} then "
                    f"{batch_num_data}); pass num_data=<size of the training set> to "
                    "bdl.observe"
                )
            num_data = batch_num_data
            log_likelihood = log_likelihood + batch_log_likelihood
            seen += examples
        # data-parallel (torchrun): every rank passed over its shard; add the passes up
        if curvature is not None:
            curvature.synchronise()
        seen, log_likelihood = distributed.sum_across_ranks(seen, log_likelihood)
        if score is not None:
            distributed.all_reduce_(score)
        # One scaling for every structure: the pass's sums stand for N examples.
        scale = num_data / seen
        if score is not None:
            score = {name: total * scale for name, total in zip(jacobians.values, score)}
        return log_likelihood * scale, score, num_data, seen, jacobians

    @staticmethod
    def _batch(jacobians, args, kwargs, curvature, score) -> tuple[torch.Tensor, int, int]:
        """One batch of :meth:`_pass`: its log likelihood, ``num_data`` and size.

        Adds the batch's curvature to ``curvature`` (if given) and its log likelihood's
        gradient to ``score`` (if given). The run and its graph live only in this call:
        held into the next batch's forward, they would double the activations' memory.
        """
        run = jacobians(args, kwargs)
        observation = run.observation
        log_likelihood = observation.log_likelihood()
        if score is not None:  # first: the curvature's backward frees the run's graph
            leaves = list(jacobians.values.values())
            grads = torch.autograd.grad(
                log_likelihood, leaves, allow_unused=True, retain_graph=curvature is not None
            )
            for total, grad in zip(score, grads):
                if grad is not None:
                    total += grad
        if curvature is not None:
            columns = observation.columns(curvature.fisher, curvature.num_samples)
            curvature.update(run.gradients(columns))
        return log_likelihood.detach(), observation.num_data, observation.num_examples

    def _log_joint_gradient(self, score, values) -> dict[str, torch.Tensor]:
        """The log joint's gradient: the likelihood's plus the prior's."""
        gradient = {}
        for name, value in values.items():
            if name in self._other_priors:
                x = value.detach().requires_grad_()
                with torch.enable_grad():
                    log_prior = _site_log_density(self._other_priors[name], x)
                    (prior_score,) = torch.autograd.grad(log_prior, x)
                gradient[name] = score[name] + prior_score
            else:
                prior_score = self._model_precision[name] * (value - self._prior_loc[name])
                gradient[name] = score[name] - prior_score
        return gradient

    def _log_prior(self, values) -> torch.Tensor:
        """The model's log prior of ``values``; its normal part up to a constant."""
        total = 0.0
        for name, value in values.items():
            if name in self._other_priors:
                total = total + _site_log_density(self._other_priors[name], value.detach())
            else:
                squares = (value - self._prior_loc[name]).square()
                total = total - 0.5 * (self._model_precision[name] * squares).sum()
        return total

    @property
    def mode_distance(self) -> float | None:
        r"""How far the fitted point is from a mode, in posterior standard deviations.

        The Newton decrement :math:`\lambda = \sqrt{g^\top P^{-1} g / T}` of :meth:`fit`
        at the current prior precision; None if the fit skipped the check
        (``mode_tolerance=None``).
        """
        self._check_fitted()
        return None if self._gradient is None else self._mode_distance()

    def _mode_distance(self) -> float:
        squared = sum(
            block.output_covariance(
                {name: DenseGradient(self._gradient[name][None, None]) for name in block.sites},
                self._prior_precision,
            ).sum()
            for block in self._blocks
        )
        return math.sqrt(max(float(squared), 0.0) / self.temperature)

    def _whiten(self, start, offsets) -> dict[str, torch.Tensor]:
        r""":math:`\theta_0 + R u` with :math:`R R^\top = P^{-1}`, differentiable in ``u``."""
        values = {}
        for block in self._blocks:
            noise = {name: offsets[name].unsqueeze(0) for name in block.sites}
            for name, step in block.sample(noise, self._prior_precision).items():
                values[name] = start[name] + step[0]
        return values

    def _refine(self, model, batches, tolerance, budget, progress) -> int:
        """L-BFGS on the log joint in whitened coordinates; returns the passes taken."""
        start = {name: value.detach() for name, value in self._loc.items()}
        offsets = {
            name: torch.zeros_like(value, requires_grad=True) for name, value in start.items()
        }
        # A long memory pays on these small non-convex problems; keep it under ~1e8 numbers.
        size = sum(value.numel() for value in start.values())
        history = max(5, min(100, 50_000_000 // size))
        lbfgs = torch.optim.LBFGS(
            list(offsets.values()),
            lr=1.0,
            max_iter=budget,
            max_eval=budget,
            tolerance_grad=0.0,
            history_size=history,
            line_search_fn="strong_wolfe",
        )
        bar = tqdm(
            total=budget, desc="MAP (L-BFGS, full passes)", disable=not progress, leave=False
        )
        passes = 0

        def closure():
            nonlocal passes
            passes += 1
            bar.update()
            lbfgs.zero_grad()
            values = self._whiten(start, offsets)
            detached = {name: value.detach() for name, value in values.items()}
            log_joint, gradient = self._log_joint(model, batches, detached)
            torch.autograd.backward(list(values.values()), [-gradient[name] for name in values])
            # In these coordinates the gradient's norm is the Newton decrement at T = 1.
            # LBFGS stops when the gradient it sees is zero: report zero once it is small.
            squared = sum(offset.grad.square().sum() for offset in offsets.values())
            if math.sqrt(float(squared) / self.temperature) <= tolerance / 2:
                for offset in offsets.values():
                    offset.grad.zero_()
            bar.set_postfix(log_joint=f"{float(log_joint):.6g}", refresh=False)
            return -log_joint

        lbfgs.step(closure)
        bar.close()
        with torch.no_grad():
            self._loc = {
                name: value.detach().clone() for name, value in self._whiten(start, offsets).items()
            }
        return passes

    def _log_joint(self, model, batches, values) -> tuple[torch.Tensor, dict]:
        """The log joint over a pass at unconstrained ``values``, and its gradient."""
        if self.exact_hessian_reason is not None:
            value, grad, _ = LogJointPass(model, self.sites, batches)(
                self.sites.pack(values), order=1
            )
            return value, self.sites.unpack(grad)
        log_likelihood, score, *_ = self._pass(model, batches, values, None, True, False)
        return log_likelihood + self._log_prior(values), self._log_joint_gradient(score, values)

    def _warn_not_a_mode(self, map, tolerance, num_steps, max_passes) -> None:
        norm = math.sqrt(sum(float(g.square().sum()) for g in self._gradient.values()))
        if map is True:
            fix = (
                f"raise max_passes (now {max_passes}) or num_steps (now {num_steps}), or "
                "pass map=<the values of a converged fit>"
            )
        else:
            given = (
                "the module's current weights (map=False)"
                if map is False
                else "the values passed as map="
            )
            fix = (
                f"{given} are not a MAP of this model (a checkpoint fitted with another prior "
                "or weight decay, or not converged): refine them with map=True, num_steps=0 "
                "(L-BFGS from them), or pass converged values"
            )
        warnings.warn(
            f"LaplaceGuide.fit: the point is not a mode of the log joint: its gradient has "
            f"norm {norm:.4g}, which puts the mode {self._mode_distance():.3g} posterior "
            f"standard deviations away (Newton decrement sqrt(g' P^-1 g / T), above "
            f"mode_tolerance={tolerance}); the mean, curvature and evidence are those of "
            f"another point. To fix: {fix}. mode_tolerance=None skips this check",
            stacklevel=3,
        )

    def _check_fitted(self) -> None:
        if self._blocks is None:
            raise RuntimeError("LaplaceGuide: call guide.fit(...) first")

    def _require_structure(self, what: str) -> None:
        self._check_fitted()
        if self.exact_hessian_reason is not None:
            raise ValueError(
                f"LaplaceGuide: {what} needs the GGN structure of a network's weights, and this "
                f"fit is the exact Hessian of the model's log joint because "
                f"{self.exact_hessian_reason}; draw from the posterior with "
                "Predictive(model, guide=guide) instead"
            )

    # -- the prior precision ---------------------------------------------------------

    @property
    def prior_precision(self) -> dict[str, torch.Tensor]:
        """:math:`\\delta` per site with a Normal prior: a 0-dim tensor, or one shaped like
        the site. Sites with other priors, and every site of an exact-Hessian fit, take
        their prior's curvature from the model and have none."""
        return {name: self._prior_precision[name] for name in self._model_precision}

    @prior_precision.setter
    def prior_precision(self, value: PriorPrecision) -> None:
        value = _checked_precision(value)
        precision = dict(self._model_precision)
        if value is not None and not precision:
            raise ValueError(
                "prior_precision: no latent site of this model has a Normal prior with fixed "
                "parameters whose precision it could set (the model's own priors enter the "
                f"curvature{': ' + self.exact_hessian_reason if self.exact_hessian_reason else ''}"
                "); change the priors' scales in the model"
            )
        if isinstance(value, Mapping):
            others = [name for name in value if name in self._other_priors]
            if others:
                fn = self.sites[others[0]].prior_name
                raise ValueError(
                    f"prior_precision names {others[0]!r}, whose prior is a {fn}, not a Normal: "
                    "its curvature comes from the model; set the Normal sites' precision only"
                )
            site_keys("prior_precision", value, precision, "the model's latent sites")
            precision.update({name: torch.as_tensor(v) for name, v in value.items()})
        elif value is not None:
            precision = {name: torch.as_tensor(value) for name in precision}
        checked = {}
        for name, delta in precision.items():
            like = self.sites[name].message["value"]
            delta = delta.to(dtype=like.dtype, device=like.device)
            try:
                fits = torch.broadcast_shapes(delta.shape, like.shape) == like.shape
            except RuntimeError:
                fits = False
            if not fits:
                raise ValueError(
                    f"prior_precision of {name!r} has shape {tuple(delta.shape)}, which does "
                    f"not broadcast to the site's shape {tuple(like.shape)}"
                )
            if not bool((delta > 0).all()) or not bool(torch.isfinite(delta).all()):
                raise ValueError(
                    f"prior_precision of {name!r} must be positive and finite, got {delta}"
                )
            if delta.numel() > 1 and bool((delta == delta.flatten()[0]).all()):
                delta = delta.flatten()[0]
            checked[name] = delta.detach()
        self._prior_precision = {**self._prior_precision, **checked}

    # -- the Gaussian ----------------------------------------------------------------

    def forward(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        r"""Draw every latent site from :math:`q`.

        One joint draw per call, or one per element of the plates around the guide
        (``Predictive(..., parallel=True)`` draws all at once): the standard normal noise
        :math:`z` is an auxiliary site that Pyro broadcasts over them, and each site is
        the deterministic :math:`T(\theta_\text{MAP} + \sqrt{T} R z)` (:math:`T` the site's
        ``biject_to``, the identity on real sites), inside the site's plates, whose log
        density adds :math:`\frac{1}{2} \log\det (P / T)` per block to the noise's, and the
        log-Jacobian of a constrained site.
        """
        self._check_fitted()
        like = next(iter(self._loc.values()))
        sizes = [value.numel() for value in self._loc.values()]
        standard = dist.Normal(like.new_zeros(sum(sizes)), 1.0).to_event(1)
        noise = pyro.sample("_LaplaceGuide_noise", standard, infer={"is_auxiliary": True})
        plates = noise.shape[:-1]
        flat = noise.reshape(-1, noise.shape[-1])
        parts = {
            name: part.reshape(len(flat), *self._loc[name].shape)
            for name, part in zip(self._loc, flat.split(sizes, -1))
        }
        draws = self._transform(parts)
        site_plates = self._create_plates(*args, **kwargs)
        result = {}
        for block in self._blocks:
            size = sum(self._loc[name].numel() for name in block.sites)
            log_det = block.log_det(self._prior_precision) - size * math.log(self.temperature)
            for k, name in enumerate(block.sites):
                site = self.sites[name]
                z = draws[name].reshape(plates + self._loc[name].shape)
                with ExitStack() as stack:
                    for frame in site.frames:
                        stack.enter_context(site_plates[frame.name])
                    delta = site.delta(z, extra=0.5 * log_det if k == 0 else 0.0)
                    result[name] = pyro.sample(name, delta)
        return result

    def _transform(self, noise: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        r""":math:`\theta_\text{MAP} + \sqrt{T} R z` for noise shaped ``(S, *site_shape)``."""
        draws = {}
        root_t = math.sqrt(self.temperature)
        for block in self._blocks:
            offsets = block.sample(
                {name: noise[name] for name in block.sites}, self._prior_precision
            )
            for name in block.sites:
                draws[name] = self._loc[name] + root_t * offsets[name]
        return draws

    def sample_posterior(
        self,
        num_samples: int,
        generator: torch.Generator | None = None,
        device: str | torch.device | None = None,
    ) -> dict[str, torch.Tensor]:
        """``num_samples`` joint draws of every site, shaped ``(num_samples, *shape)``, in
        the sites' supports.

        :param int num_samples: how many.
        :param generator: random generator of the noise.
        :param device: where to keep the draws. None: on the guide's device, all drawn at
            once. Given (``"cpu"`` for a large model on a GPU), one draw at a time, each
            copied there before the next: the guide's device holds one draw, whatever
            ``num_samples``.
        """
        self._check_fitted()
        num_samples = integer("num_samples", num_samples, low=1)
        if generator is not None:
            instance("generator", generator, torch.Generator, "a torch.Generator or None")
        if device is not None:
            instance("device", device, (str, torch.device), "a device such as 'cpu', or None")

            def one_draw() -> dict[str, torch.Tensor]:
                return {name: draw[0] for name, draw in self._draw(1, generator).items()}

            return kept_draws(one_draw, num_samples, device)
        return self._draw(num_samples, generator)

    def _draw(self, num_samples: int, generator) -> dict[str, torch.Tensor]:
        noise = {
            name: torch.randn(
                num_samples,
                *value.shape,
                dtype=value.dtype,
                device=value.device,
                generator=generator,
            )
            for name, value in self._loc.items()
        }
        draws, _ = self.sites.constrain(self._transform(noise))
        return draws

    @torch.no_grad()
    def median(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """:math:`\\theta_\\text{MAP}`, the mean (and median) of every site; :math:`T` of it,
        in the site's support, for a constrained site (as ``AutoLaplaceApproximation``)."""
        self._check_fitted()
        values, _ = self.sites.constrain(self._loc)
        return {name: value.clone() for name, value in values.items()}

    def variance(self) -> dict[str, torch.Tensor]:
        """The marginal variance of every entry, the diagonal of :math:`T P^{-1}` (of the
        unconstrained value, for a constrained site)."""
        self._check_fitted()
        result = {}
        for block in self._blocks:
            for name, variance in block.variance(self._prior_precision).items():
                result[name] = self.temperature * variance.expand(self._loc[name].shape)
        return result

    @torch.no_grad()
    def quantiles(self, quantiles, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Marginal quantiles of every site, shaped ``(len(quantiles), *shape)``, in the
        sites' supports."""
        variance = self.variance()
        q = torch.as_tensor(quantiles)
        result = {}
        for name, loc in self._loc.items():
            normal = dist.Normal(loc, variance[name].sqrt())
            values = normal.icdf(q.to(loc).reshape((-1,) + (1,) * loc.dim()))
            result[name] = self.sites[name].transform(values)
        return result

    # -- the linearised predictive ---------------------------------------------------

    def output_distribution(
        self, *args, prior_precision: PriorPrecision = None, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The Gaussian of the model's output under the linearised network.

        :math:`f(x_*) \\sim \\mathcal{N}(f_{\\theta_\\text{MAP}}(x_*), J_* \\Sigma J_*^\\top)`,
        one vector-Jacobian product per output, :math:`\\Sigma` never formed.
        DataLoader arguments are concatenated over one pass.

        :return: mean ``(B, K)`` and covariance ``(B, K, K)`` of the model's returned
            tensor (logits for a classifier).
        """
        delta = self._resolve(prior_precision)
        means, covariances = [], []
        for batch_args, batch_kwargs in Minibatches(args, kwargs).one_pass():
            mean, grads, _ = self._linearize(batch_args, batch_kwargs)
            means.append(mean)
            covariances.append(self._covariance(grads, delta))
        return torch.cat(means), torch.cat(covariances)

    def predictive(
        self,
        *args,
        link: str | None = None,
        num_samples: int = 100,
        return_samples: bool = False,
        generator: torch.Generator | None = None,
        prior_precision: PriorPrecision = None,
        progress: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        """Class probabilities of the linearised (GLM) predictive.

        See :mod:`~pyro_bdl.inference.laplace.predictive` for the links. The model must
        return logits shaped ``(B, C)``. ``"mc"`` takes ``C - 1`` vector-Jacobian products
        per batch (the logit contrasts :math:`f_k - f_C`; the softmax is shift invariant),
        ``"probit"`` and ``"bridge"`` ``C``. DataLoader arguments are concatenated over
        one pass.

        :param str link: ``"mc"`` (joint logit samples), ``"probit"`` or ``"bridge"``;
            None: :attr:`link` (``"mc"`` unless :meth:`select_link` chose another).
        :param int num_samples: logit draws for ``"mc"``.
        :param bool return_samples: return the per-draw class probabilities
            ``(S, B, C)`` (``"mc"`` only), as :func:`pyro_bdl.predict.predict_proba` does, for the
            aleatoric/epistemic split; otherwise their mean ``(B, C)``.
        :param generator: random generator for ``"mc"``.
        :param prior_precision: evaluate at this :math:`\\delta` instead of the guide's.
        """
        link = one_of("link", self.link if link is None else link, LINKS)
        num_samples = integer("num_samples", num_samples, low=1)
        instance("return_samples", return_samples, bool, "True or False")
        if generator is not None:
            instance("generator", generator, torch.Generator, "a torch.Generator or None")
        instance("progress", progress, bool, "True or False")
        if return_samples and link != "mc":
            raise ValueError(f"return_samples=True needs link='mc', got link={link!r}")
        delta = self._resolve(prior_precision)
        batches = Minibatches(args, kwargs)
        results = []
        bar = tqdm(
            batches.one_pass(),
            total=batches.batches_per_epoch,
            desc="GLM predictive",
            disable=not progress,
            leave=False,
        )
        for batch_args, batch_kwargs in bar:
            mean, grads, _ = self._linearize(batch_args, batch_kwargs, contrasts=link == "mc")
            covariance = self._covariance(grads, delta)
            probs = _link(link, mean, covariance, num_samples, generator)
            results.append(probs if return_samples or link != "mc" else probs.mean(0))
        return torch.cat(results, dim=-2)

    def _linearize(self, args: tuple, kwargs: dict, contrasts: bool = False):
        """The linearised outputs at the MAP, their per-example Jacobian rows, the run.

        With ``contrasts`` the outputs are the ``C - 1`` logit differences
        :math:`f_k - f_C`: the softmax is shift invariant, so their Gaussian carries the
        whole MC predictive at one vector-Jacobian product fewer per batch.
        """
        self._require_structure("the linearised (GLM) predictive")
        run = self._jacobians(args, kwargs, output="return")
        output = run.output
        if output.dim() != 2:
            raise ValueError(
                "the linearised predictive needs a model returning logits shaped "
                f"(batch, classes), got shape {tuple(output.shape)}"
            )
        rows = torch.eye(output.shape[1], dtype=output.dtype, device=output.device)
        if contrasts:
            rows = rows[:-1] - rows[-1]
        columns = rows.unsqueeze(1).expand(len(rows), *output.shape)
        return output.detach() @ rows.mT, run.gradients(columns), run

    def _covariance(self, grads, delta) -> torch.Tensor:
        total = sum(block.output_covariance(grads, delta) for block in self._blocks)
        return self.temperature * total

    # -- evidence and prior precision ------------------------------------------------

    def _resolve(self, prior_precision: PriorPrecision) -> dict[str, torch.Tensor]:
        self._check_fitted()
        if prior_precision is None:
            return self._prior_precision
        saved = self._prior_precision
        self.prior_precision = prior_precision
        resolved, self._prior_precision = self._prior_precision, saved
        return resolved

    def log_marginal_likelihood(self, prior_precision: PriorPrecision = None) -> torch.Tensor:
        """The Laplace evidence (see :mod:`~pyro_bdl.inference.laplace.evidence`).

        :math:`\\log p(\\mathcal{D} \\mid \\theta_\\text{MAP}) + \\log p(\\theta_\\text{MAP})
        + \\frac{d}{2}\\log 2\\pi - \\frac{1}{2}\\log\\det P` with the prior
        :math:`\\mathcal{N}(\\mu_0, \\delta^{-1})`, at temperature 1.

        :param prior_precision: evaluate at this :math:`\\delta` instead of the guide's.
        """
        self._check_fitted()
        return self._evidence(self._resolve(prior_precision))

    def _evidence(self, delta: dict[str, torch.Tensor]) -> torch.Tensor:
        # differentiable in delta, which the prior_precision setter would detach. The
        # priors that are not Normal (none, in an exact-Hessian fit, whose first term is
        # the whole log joint) add their log density at the mode to the likelihood's.
        other = {name: self._loc[name] for name in self._other_priors}
        return log_marginal_likelihood(
            self._log_likelihood + self._log_prior(other),
            self._blocks,
            self._loc,
            self._prior_loc,
            {**self._prior_precision, **delta},
        )

    def optimize_prior_precision(
        self,
        method: str = "marglik",
        *val_args,
        structure: str = "layer",
        num_steps: int = 1000,
        lr: float = 0.1,
        grid: torch.Tensor | None = None,
        link: str = "probit",
        num_samples: int = 100,
        progress: bool = False,
        **val_kwargs,
    ) -> dict[str, torch.Tensor]:
        """Tune :math:`\\delta` without refitting the curvature.

        ``"marglik"`` maximises the evidence (eq. 13) on the training data by Adam on
        :math:`\\log\\delta` (Laplace-LoRA: lr 0.1, 1000 steps), and warns if the
        evidence's gradient has not vanished by the last step. ``"gridsearch"`` picks, on
        the validation data ``val_args`` (the model's arguments, labels observed), the
        grid value with the lowest negative log likelihood of the linearised predictive.

        ``structure`` says what is tuned. ``"layer"`` (the default): for ``"marglik"`` one
        :math:`\\delta` per latent site (per weight tensor), each started at its current
        value; for ``"gridsearch"`` one factor :math:`c` that multiplies every site's
        current :math:`\\delta`, so that a per-site profile is kept and scaled as a whole.
        ``"scalar"``: one :math:`\\delta` shared by every site (the grid's values are
        :math:`\\delta` itself).

        The recommended recipe: lift the network with a fan-in-scaled prior
        (:meth:`pyro_bdl.priors.LayerwiseNormal.fan_in`, so that every weight tensor starts
        at a precision that suits its width), tune per site by the evidence (the default
        call), and choose the predictive's link on validation data
        (:meth:`select_link`). With validation data to spare, the grid search is the
        one-line alternative, and may follow the evidence to rescale its profile.

        Example::

            guide.optimize_prior_precision()                              # per-site evidence
            guide.optimize_prior_precision("gridsearch", val_loader, num_data)
            link, nll = guide.select_link(val_loader, num_data)

        :param str method: ``"marglik"`` or ``"gridsearch"``.
        :param str structure: ``"layer"`` or ``"scalar"``.
        :param int num_steps: Adam steps for ``"marglik"``.
        :param float lr: Adam learning rate for ``"marglik"``.
        :param torch.Tensor grid: candidate values for ``"gridsearch"`` (default
            ``logspace(-4, 4, 41)``).
        :param str link: the predictive's link for ``"gridsearch"``.
        :param int num_samples: logit draws if ``link="mc"``.
        :param bool progress: show a progress bar over the validation batches.
        :return: the new prior precision per site.
        """
        self._check_fitted()
        one_of("method", method, ("marglik", "gridsearch"))
        one_of("structure", structure, ("scalar", "layer"))
        sites = list(self._model_precision)
        if not sites:
            raise ValueError(
                "optimize_prior_precision: no latent site of this model has a Normal prior "
                "with fixed parameters, so there is no prior precision to tune (the priors' "
                "curvature comes from the model); tune the prior's scale in the model"
            )
        if method == "marglik":
            if val_args or val_kwargs:
                raise ValueError("method='marglik' uses the training data only; drop val_args")
            num_steps = integer("num_steps", num_steps, low=1)
            lr = real("lr", lr, positive=True)
            groups = {"all": sites} if structure == "scalar" else {s: [s] for s in sites}
            init = {
                group: torch.stack([self._prior_precision[s].mean() for s in members]).mean()
                for group, members in groups.items()
            }
            sizes = {site: value.numel() for site, value in self._loc.items()}
            tuned = maximise_evidence(self._evidence, groups, init, num_steps, lr, sizes)
            self._prior_precision = {**self._prior_precision, **tuned}
            return self.prior_precision
        if not val_args and not val_kwargs:
            raise ValueError(
                "method='gridsearch' needs the validation data: "
                "optimize_prior_precision('gridsearch', val_loader, num_data)"
            )
        one_of("link", link, LINKS)
        like = next(iter(self._loc.values()))
        grid = torch.logspace(-4, 4, 41) if grid is None else torch.as_tensor(grid)
        grid = grid.to(like).reshape(-1)
        if not bool((grid > 0).all()) or not bool(torch.isfinite(grid).all()):
            raise ValueError(f"grid must hold positive finite prior precisions, got {grid}")
        if structure == "scalar":
            candidates = [{site: value for site in sites} for value in grid]
        else:
            candidates = [
                {site: value * self._prior_precision[site] for site in sites} for value in grid
            ]
        candidates = [{**self._prior_precision, **candidate} for candidate in candidates]
        nll = self._validation_nll(val_args, val_kwargs, candidates, (link,), num_samples, progress)
        best = candidates[int(nll[:, 0].argmin())]
        self._prior_precision = {site: delta.detach().clone() for site, delta in best.items()}
        return self.prior_precision

    def select_link(
        self,
        *val_args,
        links: tuple[str, ...] = LINKS,
        num_samples: int = 100,
        progress: bool = False,
        **val_kwargs,
    ) -> tuple[str, dict[str, float]]:
        """The link of the linearised predictive with the lowest NLL on validation data.

        Each link (see :meth:`predictive`) maps the same Gaussian over the logits to class
        probabilities; which suits a model is an empirical question (Laplace-LoRA found
        ``"mc"`` best for LLMs, the bridge can win for a small, well-fitted network), so
        answer it on held-out data, not on the test set. The best becomes :attr:`link`,
        the default of :meth:`predictive` (and is saved with the guide).

        Example::

            link, scores = guide.select_link(val_loader, num_data)
            probs = guide.predictive(test_batch, num_data)        # with that link

        :param val_args: the model's arguments on the validation data (labels observed).
        :param tuple links: the candidates, a subset of ``("mc", "probit", "bridge")``.
        :param int num_samples: logit draws for ``"mc"``.
        :return: the best link and the mean validation NLL of each.
        """
        self._check_fitted()
        if not val_args and not val_kwargs:
            raise ValueError(
                "select_link needs the validation data: select_link(val_loader, num_data)"
            )
        links = tuple(links)
        if not links:
            raise ValueError("links must name at least one of ('mc', 'probit', 'bridge')")
        for name in links:
            one_of("links", name, LINKS)
        nll = self._validation_nll(
            val_args, val_kwargs, [self._prior_precision], links, num_samples, progress
        )[0]
        scores = {name: float(value) for name, value in zip(links, nll, strict=True)}
        self.link = links[int(nll.argmin())]
        return self.link, scores

    def _validation_nll(self, args, kwargs, candidates, links, num_samples, progress):
        """Mean NLL ``(len(candidates), len(links))`` of the linearised predictive.

        One linearisation per batch serves every candidate prior precision and link.
        """
        num_samples = integer("num_samples", num_samples, low=1)
        like = next(iter(self._loc.values()))
        total = torch.zeros(len(candidates), len(links), dtype=like.dtype, device=like.device)
        count = 0
        generator = torch.Generator(device=like.device).manual_seed(0)
        batches = Minibatches(args, kwargs)
        bar = tqdm(
            batches.one_pass(),
            total=batches.batches_per_epoch,
            desc="validation NLL",
            disable=not progress,
            leave=False,
        )
        for batch_args, batch_kwargs in bar:
            mean, grads, run = self._linearize(batch_args, batch_kwargs)
            if not run.observation.is_observed:
                raise ValueError("the validation batches must carry labels")
            labels = run.observation.value.long().unsqueeze(-1)
            for i, delta in enumerate(candidates):
                covariance = self._covariance(grads, delta)
                for j, name in enumerate(links):
                    probs = _link(name, mean, covariance, num_samples, generator, contrasts=False)
                    probs = probs.mean(0) if name == "mc" else probs
                    picked = probs.gather(-1, labels).squeeze(-1)
                    total[i, j] -= picked.clamp(min=torch.finfo(probs.dtype).tiny).log().sum()
            count += len(labels)
        # data-parallel: every rank's validation shard
        count = torch.tensor(float(count), dtype=like.dtype, device=like.device)
        distributed.all_reduce_([total, count])
        return total / count

    # -- continual learning and export -----------------------------------------------

    def as_prior(self, prefix: str = "") -> LaplacePrior:
        """This posterior as a prior for :func:`pyro_bdl.lift` (continual learning).

        :param str prefix: the ``prefix`` of the :func:`~pyro_bdl.lift` call.
        """
        instance("prefix", prefix, str, "a string (the prefix given to bdl.lift)")
        self._require_structure("as_prior (a prior for the weights of bdl.lift)")
        blocks = {name: block.restrict(name) for block in self._blocks for name in block.sites}
        loc = {name: value.clone() for name, value in self._loc.items()}
        return LaplacePrior(loc, blocks, self._prior_precision, self.temperature, prefix)

    def approximation_parameters(self) -> dict[str, torch.Tensor]:
        """The Gaussian's parameters, for ``bdl.to_arviz``.

        Per site ``"<site>.loc"`` (MAP), ``"<site>.scale"`` (marginal standard deviation),
        both of the unconstrained value for a constrained site, and
        ``"<site>.prior_precision"`` (where the site has one: its Normal prior's, or a
        prior's own curvature), plus the curvature's own tensors (diagonals, Kronecker
        eigendecompositions, or the dense matrix).
        """
        self._check_fitted()
        variance = self.variance()
        result = {}
        for name, loc in self._loc.items():
            result[f"{name}.loc"] = loc.clone()
            result[f"{name}.scale"] = variance[name].sqrt()
            if name in self._prior_precision:
                result[f"{name}.prior_precision"] = self._prior_precision[name].clone()
        for block in self._blocks:
            result.update({key: value.detach().clone() for key, value in block.tensors().items()})
        return result

    # -- saving (see pyro_bdl.inference.guide_state and bdl.save) -----------------------

    _needs_setup = False  # a fitted state restores without the model's prototype

    def _init_settings(self) -> dict:
        return {"curvature": self.curvature.hyperparameters(), "temperature": self.temperature}

    @classmethod
    def _from_settings(cls, model, settings: dict) -> LaplaceGuide:
        curvature = curvature_from_settings(settings["curvature"])
        return cls(model, curvature, temperature=settings["temperature"])

    def _state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        return laplace_state(self)

    def _restore(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        restore_laplace(self, state, tensors)

    def _site_shapes(self) -> dict[str, dict] | None:
        if self._blocks is None:
            return None  # unfitted: nothing to save, nothing to check a state against
        return {
            name: {"shape": list(value.shape), "dtype": dtype_name(value.dtype)}
            for name, value in self._loc.items()
        }

    def hyperparameters(self) -> dict:
        """The guide's settings and evidence, JSON-serialisable."""
        self._check_fitted()
        precision = {
            name: float(delta) if delta.numel() == 1 else "per-entry (from the model's prior)"
            for name, delta in self.prior_precision.items()
        }
        values = set(precision.values())
        curvature = self.curvature.hyperparameters()
        if self.exact_hessian_reason is not None:
            curvature["fisher"] = "hessian"
            precision = "from the model (the exact Hessian of its log joint)"
            values = set()
        return {
            "method": "LaplaceGuide",
            **curvature,
            "temperature": self.temperature,
            "link": self.link,
            "num_data": self.num_data,
            "num_params": sum(value.numel() for value in self._loc.values()),
            "prior_precision": values.pop() if len(values) == 1 else precision,
            "log_marginal_likelihood": float(self.log_marginal_likelihood().detach()),
        }


def _warn_if_adapters_untrained(values: Mapping[str, torch.Tensor]) -> None:
    """Warn when every LoRA pair among the sites has the update ``B @ A = 0``: the adapters
    of a fresh LoRA model (``B = 0``), or the ``A = B = 0`` mode that a MAP search from
    there falls into. The approximation is then of the pretrained network, whose new head
    predicts about the same for every input: a silent no-op."""
    updates = [
        values[name.replace("lora_A", "lora_B")] @ value
        for name, value in values.items()
        if "lora_A" in name and name.replace("lora_A", "lora_B") in values and value.dim() == 2
    ]
    # A fine-tuned adapter's update is 1e-4 to 1e-1 per entry; these are 0 or ~1e-14.
    if updates and all(float(update.abs().max()) < 1e-8 for update in updates):
        warnings.warn(
            f"LaplaceGuide.fit: the LoRA adapters are still at their initialisation (B @ A = 0 "
            f"in all {len(updates)} adapted layers), so this is the Laplace approximation of the "
            "pretrained network, which predicts about the same for every input. Fine-tune "
            "first (e.g. pyro_bdl.inference.baselines.map_estimate), then fit(..., map=False) "
            "at the fine-tuned weights (or map=<their values>)",
            stacklevel=3,
        )


def _checked_precision(value: PriorPrecision) -> PriorPrecision:
    """``prior_precision`` as far as it can be checked without the model."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        for name, delta in value.items():
            instance("prior_precision's keys", name, str, "latent site names")
            _check_delta(f"prior_precision[{name!r}]", delta)
        return value
    if torch.is_tensor(value) and value.numel() != 1:
        raise TypeError(
            f"prior_precision must be None, a number or a dict site -> number or tensor; a "
            f"tensor of shape {tuple(value.shape)} belongs in the dict, under its site"
        )
    return real("prior_precision", value, positive=True)


def _check_delta(name: str, delta: object) -> None:
    if not (torch.is_tensor(delta) and delta.numel() > 1):
        real(name, delta, positive=True)
    elif not delta.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {delta.dtype}")
    elif not bool((delta > 0).all()) or not bool(torch.isfinite(delta).all()):
        raise ValueError(f"{name} must be positive and finite in every entry")


def _link(link, mean, covariance, num_samples, generator, contrasts=True) -> torch.Tensor:
    """Class probabilities of the logits' Gaussian (MC: the draws, ``(S, B, C)``).

    With ``contrasts`` the MC link's Gaussian is that of the contrasts :math:`f_k - f_C`,
    :math:`k < C` (see ``_linearize``); otherwise, as for the other links, of the logits.
    """
    if link == "mc":
        if contrasts:
            padded = torch.nn.functional.pad
            mean, covariance = padded(mean, (0, 1)), padded(covariance, (0, 1, 0, 1))
        return mc_probabilities(mean, covariance, num_samples, generator)
    if link == "probit":
        return probit(mean, covariance)
    return laplace_bridge(mean, covariance)


def _no_structure(name: str, site, fixed: set[str]) -> str | None:
    """Why a latent site rules out the GGN and Fisher curvatures, or None."""
    if not site.is_real:
        return f"the site {name!r} has the constrained support {site.message['fn'].support}"
    if name not in fixed:
        return f"the prior of {name!r} depends on other latent sites (a hierarchical prior)"
    base = site.message["fn"]
    while isinstance(base, (dist.Independent, dist.ExpandedDistribution, dist.MaskedDistribution)):
        base = base.base_dist
    if base.event_shape:
        return f"the prior of {name!r} ({type(base).__name__}) couples the entries of its event"
    return None


def _site_log_density(message: dict, value: torch.Tensor) -> torch.Tensor:
    """A site's log density at ``value``, scaled and masked as the model has it."""
    log_prob = message["fn"].log_prob(value)
    return scale_and_mask(log_prob, message["scale"], message["mask"]).sum()


def _check_positive_definite(block: HessianBlock, reason: str) -> None:
    eigenvalues = torch.linalg.eigvalsh(block.hessian)
    if not bool(eigenvalues[0] > 0):
        raise ValueError(
            f"LaplaceGuide: the negative Hessian of the log joint at the fitted point is not "
            f"positive definite (smallest eigenvalue {float(eigenvalues[0]):.3g}), so the point "
            "is not a mode and there is no Laplace approximation there (the exact Hessian "
            f"is used because {reason}). Fit the mode with map=True (more num_steps or "
            "max_passes), or check the posterior has one (a funnel, such as the centred "
            "eight schools, has none)"
        )
