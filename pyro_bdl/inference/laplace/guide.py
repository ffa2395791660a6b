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

The guide is the approximation: drawing (:meth:`~LaplaceGuide.forward`,
:meth:`~LaplaceGuide.sample_posterior`), its summaries (``median``, ``quantiles``,
``variance``, ``get_posterior``) and ``as_prior`` live in this module. What the fit found
is one frozen value, a :class:`~.approximation.LaplaceFit` (the MAP, the curvature blocks,
the prior precision, the link, the model linearised at the MAP), which the guide holds as
:attr:`~LaplaceGuide.laplace_fit`, replaced as a whole and only by
:meth:`LaplaceGuide._adopt`. The modules beside the guide take a fit and return a result
or a new fit: :mod:`~pyro_bdl.inference.laplace.fitting` (the MAP stage, the whitened
L-BFGS refinement, the mode check) and :mod:`~pyro_bdl.inference.laplace.curvature_pass`
(the pass over the data) make one, :mod:`~pyro_bdl.inference.laplace.predictive` (the GLM
predictive and its links) reads one, :mod:`~pyro_bdl.inference.laplace.tuning` (prior
precision and link selection) returns a new one, and
:mod:`~pyro_bdl.inference.laplace.serialization` saves and restores one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import ExitStack

import pyro
import pyro.distributions as dist
import torch
from pyro.infer.autoguide import AutoGuide
from pyro.infer.autoguide.initialization import InitMessenger

from pyro_bdl._checks import function, instance, integer, one_of, real
from pyro_bdl._offload import kept_draws
from pyro_bdl.inference.guide_state import GuideState, dtype_name
from pyro_bdl.inference.laplace import fitting, tuning
from pyro_bdl.inference.laplace.approximation import LaplaceFit, LaplaceProblem
from pyro_bdl.inference.laplace.curvature import Curvature, DiagonalBlock, Full, make_curvature
from pyro_bdl.inference.laplace.laplace_prior import LaplacePrior
from pyro_bdl.inference.laplace.model_prior import PriorPrecision, checked_precision, read_priors
from pyro_bdl.inference.laplace.predictive import LINKS, glm_predictive, output_distribution
from pyro_bdl.inference.laplace.serialization import (
    curvature_from_settings,
    laplace_state,
    restore_laplace,
    saved_sites,
)
from pyro_bdl.inference.sites import LatentSites
from pyro_bdl.lift import init_to_module

__all__ = ["LaplaceGuide"]

# The most latent entries get_posterior gives a dense covariance for when the curvature
# is not dense already (Full's default max_params: the same d x d matrix).
_DENSE_LIMIT = 10_000


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

    What the fit found is one frozen :class:`~pyro_bdl.inference.LaplaceFit`
    (:attr:`laplace_fit`): tuning the prior precision or the link gives the guide a new
    one, never changes it in place.

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
        prior_precision = checked_precision(prior_precision)
        curvature = make_curvature(curvature)
        super().__init__(InitMessenger(init_loc_fn)(model))
        self._laplace_model = (model,)  # a tuple keeps nn.Module from registering it
        self.curvature = curvature
        self._temperature = temperature
        self.init_loc_fn = init_loc_fn
        self._prior_precision_arg = prior_precision
        self._adopt(None)

    def _adopt(self, fit: LaplaceFit | None) -> None:
        """Make ``fit`` the guide's fitted state: the one place it is written."""
        self._fit = fit

    @property
    def laplace_fit(self) -> LaplaceFit:
        """What the fit found, one frozen :class:`~pyro_bdl.inference.LaplaceFit`; tuning
        replaces it with a new one."""
        if self._fit is None:
            raise RuntimeError("LaplaceGuide: call guide.fit(...) first")
        return self._fit

    @property
    def temperature(self) -> float:
        """:math:`T`; setting it tempers the fitted posterior too, :math:`\\Sigma = T P^{-1}`
        (the curvature is not refitted)."""
        return self._temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        self._temperature = real("temperature", value, positive=True)
        if self._fit is not None:
            self._adopt(self._fit.with_temperature(self._temperature))

    @property
    def link(self) -> str:
        """The link :meth:`predictive` uses by default: ``"mc"``, or what :meth:`select_link`
        chose (saved with the guide)."""
        return "mc" if self._fit is None else self._fit.link

    @link.setter
    def link(self, value: str) -> None:
        self._adopt(self.laplace_fit.with_link(one_of("link", value, LINKS)))

    @property
    def num_data(self) -> int:
        """:math:`N`, the size of the data set the fit passed over."""
        return self.laplace_fit.num_data

    @property
    def exact_hessian_reason(self) -> str | None:
        """Why the exact Hessian of the log joint is used (None: the curvature's structure,
        or not fitted)."""
        return None if self._fit is None else self._fit.exact_hessian_reason

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
        fit = fitting.fit(
            self._laplace_model[0],
            self._problem,
            args,
            kwargs,
            map=map,
            num_steps=num_steps,
            optimizer=optimizer,
            max_passes=max_passes,
            mode_tolerance=mode_tolerance,
            progress=progress,
        )
        self._adopt(fit.with_link(self.link))  # a refit keeps the link chosen
        return self

    def _problem(self, args: tuple, kwargs: dict) -> LaplaceProblem:
        """What :meth:`fit` approximates, set up on the arguments of one batch."""
        self._setup_prototype(*args, **kwargs)
        return LaplaceProblem(
            model=self._laplace_model[0],
            sites=self.sites,
            prior=read_priors(
                self.sites, self.model, args, kwargs, self.curvature, self._prior_precision_arg
            ),
            curvature=self.curvature,
            temperature=self.temperature,
            requested=self._prior_precision_arg,
            init_loc_fn=self.init_loc_fn,
        )

    def _setup_prototype(self, *args, **kwargs) -> None:
        super()._setup_prototype(*args, **kwargs)
        self.sites = LatentSites(self.prototype_trace, "LaplaceGuide")
        if not self.sites:
            raise ValueError("LaplaceGuide: the model has no latent sample sites")
        self.sites.refuse_local(
            "the Laplace approximation is over global sites, as Pyro's AutoLaplaceApproximation's"
        )

    @property
    def mode_distance(self) -> float | None:
        r"""How far the fitted point is from a mode, in posterior standard deviations.

        The Newton decrement :math:`\lambda = \sqrt{g^\top P^{-1} g / T}` of :meth:`fit`
        at the current prior precision; None if the fit skipped the check
        (``mode_tolerance=None``).
        """
        return self.laplace_fit.mode_distance

    # -- the prior precision ---------------------------------------------------------

    @property
    def prior_precision(self) -> dict[str, torch.Tensor]:
        """:math:`\\delta` per site with a Normal prior: a 0-dim tensor, or one shaped like
        the site. Sites with other priors, and every site of an exact-Hessian fit, take
        their prior's curvature from the model and have none."""
        fit = self.laplace_fit
        return {name: fit.prior_precision[name] for name in fit.prior.precision}

    @prior_precision.setter
    def prior_precision(self, value: PriorPrecision) -> None:
        self._adopt(self.laplace_fit.with_prior_precision(value))

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
        fit = self.laplace_fit
        like = next(iter(fit.loc.values()))
        sizes = [value.numel() for value in fit.loc.values()]
        standard = dist.Normal(like.new_zeros(sum(sizes)), 1.0).to_event(1)
        noise = pyro.sample("_LaplaceGuide_noise", standard, infer={"is_auxiliary": True})
        plates = noise.shape[:-1]
        flat = noise.reshape(-1, noise.shape[-1])
        parts = {
            name: part.reshape(len(flat), *fit.loc[name].shape)
            for name, part in zip(fit.loc, flat.split(sizes, -1))
        }
        draws = fit.draws(parts)
        site_plates = self._create_plates(*args, **kwargs)
        result = {}
        for block in fit.blocks:
            size = sum(fit.loc[name].numel() for name in block.sites)
            log_det = block.log_det(fit.prior_precision) - size * math.log(fit.temperature)
            for k, name in enumerate(block.sites):
                site = self.sites[name]
                z = draws[name].reshape(plates + fit.loc[name].shape)
                with ExitStack() as stack:
                    for frame in site.frames:
                        stack.enter_context(site_plates[frame.name])
                    delta = site.delta(z, extra=0.5 * log_det if k == 0 else 0.0)
                    result[name] = pyro.sample(name, delta)
        return result

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
        fit = self.laplace_fit
        num_samples = integer("num_samples", num_samples, low=1)
        if generator is not None:
            instance("generator", generator, torch.Generator, "a torch.Generator or None")
        if device is not None:
            instance("device", device, (str, torch.device), "a device such as 'cpu', or None")

            def one_draw() -> dict[str, torch.Tensor]:
                return {name: draw[0] for name, draw in self._draw(fit, 1, generator).items()}

            return kept_draws(one_draw, num_samples, device)
        return self._draw(fit, num_samples, generator)

    def _draw(self, fit: LaplaceFit, num_samples: int, generator) -> dict[str, torch.Tensor]:
        noise = {
            name: torch.randn(
                num_samples,
                *value.shape,
                dtype=value.dtype,
                device=value.device,
                generator=generator,
            )
            for name, value in fit.loc.items()
        }
        draws, _ = self.sites.constrain(fit.draws(noise))
        return draws

    @torch.no_grad()
    def median(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """:math:`\\theta_\\text{MAP}`, the mean (and median) of every site; :math:`T` of it,
        in the site's support, for a constrained site (as ``AutoLaplaceApproximation``)."""
        fit = self.laplace_fit
        values, _ = self.sites.constrain(fit.loc)
        return {name: value.clone() for name, value in values.items()}

    def variance(self) -> dict[str, torch.Tensor]:
        """The marginal variance of every entry, the diagonal of :math:`T P^{-1}` (of the
        unconstrained value, for a constrained site)."""
        return self.laplace_fit.variance()

    @torch.no_grad()
    def quantiles(self, quantiles, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Marginal quantiles of every site, shaped ``(len(quantiles), *shape)``, in the
        sites' supports."""
        variance = self.variance()
        q = torch.as_tensor(quantiles)
        result = {}
        for name, loc in self.laplace_fit.loc.items():
            normal = dist.Normal(loc, variance[name].sqrt())
            values = normal.icdf(q.to(loc).reshape((-1,) + (1,) * loc.dim()))
            result[name] = self.sites[name].transform(values)
        return result

    @torch.no_grad()
    def get_posterior(self, *args, **kwargs) -> torch.distributions.Distribution:
        r""":math:`q` as a torch distribution over the flat unconstrained latent vector.

        The vector is every site's unconstrained value flattened, end to end in the
        model's order (as Pyro's ``AutoContinuous`` guides, ``AutoLaplaceApproximation``
        and ``AutoMultivariateNormal``, pack it), with mean :math:`\theta_\text{MAP}` and
        covariance :math:`T P^{-1}`. A diagonal curvature gives
        ``Normal(loc, scale).to_event(1)`` at any size; the others a
        ``MultivariateNormal``, whose dense covariance is the curvature's own for
        ``"full"`` and is formed from the blocks (K-FAC) for up to 10,000 entries. A
        larger K-FAC posterior has no torch distribution short of that matrix (its
        covariance, :math:`(A \otimes G + \delta)^{-1}`, is neither diagonal nor a
        positive low-rank update of one): the error says what to use instead.

        Example::

            posterior = guide.get_posterior()
            z = posterior.sample((100,))                 # (100, d)
            values = guide.sites.unpack(z)               # per site, unconstrained

        :param args: the model's arguments (unused: the fitted guide knows its sites;
            accepted as Pyro's guides take them).
        :return: ``Independent(Normal)`` or ``MultivariateNormal`` of event shape ``(d,)``.
        """
        fit = self.laplace_fit
        loc = self.sites.pack(fit.loc)
        if all(isinstance(block, DiagonalBlock) for block in fit.blocks):
            scale = self.sites.pack(self.variance()).sqrt()
            return dist.Normal(loc, scale).to_event(1)
        if len(loc) > _DENSE_LIMIT and not isinstance(self.curvature, Full):
            raise NotImplementedError(
                f"LaplaceGuide.get_posterior: the {self.curvature.name} posterior over "
                f"{len(loc)} entries has no torch distribution short of its dense "
                f"{len(loc)} x {len(loc)} covariance (more than {_DENSE_LIMIT} entries). "
                "Draw from it with guide.sample_posterior(n) or Predictive(model, "
                "guide=guide), read its marginals with guide.variance() or "
                "guide.quantiles(...), or take it as a prior with guide.as_prior()"
            )
        return dist.MultivariateNormal(loc, covariance_matrix=self._dense_covariance())

    def _dense_covariance(self) -> torch.Tensor:
        r""":math:`T P^{-1}` as a ``(d, d)`` matrix: block by block, each from :math:`R`
        (:math:`R R^\top = P^{-1}`) applied to the unit vectors."""
        fit = self.laplace_fit
        loc = self.sites.pack(fit.loc)
        covariance = loc.new_zeros(len(loc), len(loc))
        positions = self.sites.unpack(torch.arange(len(loc), device=loc.device))
        for block in fit.blocks:
            index = torch.cat([positions[name].reshape(-1) for name in block.sites])
            eye = torch.eye(len(index), dtype=loc.dtype, device=loc.device)
            sizes = [fit.loc[name].numel() for name in block.sites]
            noise = {
                name: part.reshape(len(index), *fit.loc[name].shape)
                for name, part in zip(block.sites, eye.split(sizes, -1))
            }
            root = block.sample(noise, fit.prior_precision)  # row j: R e_j
            root = torch.cat([root[name].reshape(len(index), -1) for name in block.sites], -1)
            covariance[index.unsqueeze(-1), index] = fit.temperature * (root.mT @ root)
        return covariance

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
        fit = self.laplace_fit
        return output_distribution(fit, args, kwargs, fit.resolve(prior_precision))

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
        return glm_predictive(
            self.laplace_fit,
            args,
            kwargs,
            link=link,
            num_samples=num_samples,
            return_samples=return_samples,
            generator=generator,
            prior_precision=prior_precision,
            progress=progress,
        )

    def predict_proba(
        self,
        *args,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
        link: str | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """The :class:`~pyro_bdl.posterior.Posterior` interface's class probabilities
        ``(S, B, C)``: the linearised predictive at the guide's :attr:`link`, its
        ``num_samples`` (default 100) joint logit draws for ``"mc"``, one row of
        closed-form probabilities (``S = 1``) for ``"probit"`` and ``"bridge"``.

        :param int num_samples: logit draws for ``"mc"``.
        :param generator: random generator for ``"mc"``.
        :param str link: another link than :attr:`link` for this call.
        """
        if (link or self.link) != "mc":
            return self.predictive(*args, link=link or self.link, **kwargs).unsqueeze(0)
        return self.predictive(
            *args,
            link="mc",
            num_samples=100 if num_samples is None else num_samples,
            return_samples=True,
            generator=generator,
            **kwargs,
        )

    # -- evidence and prior precision ------------------------------------------------

    def log_marginal_likelihood(self, prior_precision: PriorPrecision = None) -> torch.Tensor:
        """The Laplace evidence (see :mod:`~pyro_bdl.inference.laplace.evidence`).

        :math:`\\log p(\\mathcal{D} \\mid \\theta_\\text{MAP}) + \\log p(\\theta_\\text{MAP})
        + \\frac{d}{2}\\log 2\\pi - \\frac{1}{2}\\log\\det P` with the prior
        :math:`\\mathcal{N}(\\mu_0, \\delta^{-1})`, at temperature 1.

        :param prior_precision: evaluate at this :math:`\\delta` instead of the guide's.
        """
        fit = self.laplace_fit
        return tuning.evidence(fit, fit.resolve(prior_precision))

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
        tuned = tuning.optimize_prior_precision(
            self.laplace_fit,
            method,
            val_args,
            val_kwargs,
            structure=structure,
            num_steps=num_steps,
            lr=lr,
            grid=grid,
            link=link,
            num_samples=num_samples,
            progress=progress,
        )
        self._adopt(tuned)
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
        chosen, scores = tuning.select_link(
            self.laplace_fit,
            val_args,
            val_kwargs,
            links=links,
            num_samples=num_samples,
            progress=progress,
        )
        self._adopt(chosen)
        return chosen.link, scores

    # -- continual learning and export -----------------------------------------------

    def as_prior(self, prefix: str = "") -> LaplacePrior:
        """This posterior as a prior for :func:`pyro_bdl.lift` (continual learning).

        :param str prefix: the ``prefix`` of the :func:`~pyro_bdl.lift` call.
        """
        instance("prefix", prefix, str, "a string (the prefix given to bdl.lift)")
        fit = self.laplace_fit
        fit.require_structure("as_prior (a prior for the weights of bdl.lift)")
        blocks = {name: block.restrict(name) for block in fit.blocks for name in block.sites}
        loc = {name: value.clone() for name, value in fit.loc.items()}
        return LaplacePrior(loc, blocks, fit.prior_precision, fit.temperature, prefix)

    def approximation_parameters(self) -> dict[str, torch.Tensor]:
        """The Gaussian's parameters, for ``bdl.to_arviz``.

        Per site ``"<site>.loc"`` (MAP), ``"<site>.scale"`` (marginal standard deviation),
        both of the unconstrained value for a constrained site, and
        ``"<site>.prior_precision"`` (where the site has one: its Normal prior's, or a
        prior's own curvature), plus the curvature's own tensors (diagonals, Kronecker
        eigendecompositions, or the dense matrix).
        """
        fit = self.laplace_fit
        variance = fit.variance()
        result = {}
        for name, loc in fit.loc.items():
            result[f"{name}.loc"] = loc.clone()
            result[f"{name}.scale"] = variance[name].sqrt()
            if name in fit.prior_precision:
                result[f"{name}.prior_precision"] = fit.prior_precision[name].clone()
        for block in fit.blocks:
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
        return laplace_state(self._fit, self.sites)

    def _restore(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        if not state.get("fitted"):
            return
        if self.prototype_trace is None:  # a bare torch load: the sites from the state
            self.sites = saved_sites(state, tensors)
        model = self._laplace_model[0]
        self._adopt(restore_laplace(state, tensors, model, self.sites, self.temperature))

    def _site_shapes(self) -> dict[str, dict] | None:
        if self._fit is None:
            return None  # unfitted: nothing to save, nothing to check a state against
        return {
            name: {"shape": list(value.shape), "dtype": dtype_name(value.dtype)}
            for name, value in self._fit.loc.items()
        }

    def hyperparameters(self) -> dict:
        """The guide's settings and evidence, JSON-serialisable."""
        fit = self.laplace_fit
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
            "num_params": sum(value.numel() for value in fit.loc.values()),
            "prior_precision": values.pop() if len(values) == 1 else precision,
            "log_marginal_likelihood": float(self.log_marginal_likelihood().detach()),
        }
