r"""IVON's variational posterior: a diagonal Gaussian whose precision is a Hessian estimate.

IVON (Shen et al., 2024) fits :math:`q(\theta) = \mathcal{N}(m, \mathrm{diag}(\sigma^2))`
to the objective :math:`\lambda\, \mathbb{E}_q[\bar\ell(\theta)] + \mathrm{KL}(q \,\|\,
\mathcal{N}(0, I / (\lambda\delta)))`, where :math:`\bar\ell` is the mean negative log
likelihood per data point, :math:`\lambda` the effective sample size and :math:`\delta` the
weight decay, with

.. math::

    \sigma = \frac{1}{\sqrt{\lambda\,(h + \delta)}},

:math:`h` a running estimate of the diagonal of :math:`\mathbb{E}_q[\nabla^2 \bar\ell]`.
With the model's own prior :math:`\mathcal{N}(\mu, \sigma_p^2)` and :math:`N` data points
the tempered posterior :math:`p(\theta \mid y)^{1/T}` of the other methods is this
objective's target when

.. math::

    \lambda = N / T, \qquad \delta = \frac{1}{N \sigma_p^2},

so that :math:`\lambda (h + \delta) = (N h + \sigma_p^{-2}) / T` is the tempered posterior
precision: the likelihood's curvature plus the prior's, divided by :math:`T`. Training is
:class:`~pyro_bdl.inference.IVONSVI` / :func:`~pyro_bdl.inference.fit_ivon`.

A site whose prior is not such a Normal (another distribution, a Normal whose
parameters are other latent sites, a masked one) or whose support is constrained (the
Gaussian is then on the unconstrained value :math:`z`, :math:`x = T(z)`, see
:mod:`pyro_bdl.inference.sites`) has :math:`\delta = 0`: its log prior and the
log-Jacobian :math:`\log|\partial x / \partial z|` join the likelihood in
:math:`\bar\ell`, and :math:`h` estimates their curvature with the likelihood's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pyro
import torch
from pyro.distributions import constraints
from pyro.nn.module import PyroParam

from pyro_bdl import _checks
from pyro_bdl.inference.log_joint import observed_num_data
from pyro_bdl.inference.vi.mean_field import MeanFieldGuide
from pyro_bdl.lift import init_to_module

__all__ = ["IVONGuide"]


class IVONGuide(MeanFieldGuide):
    r"""The IVON posterior :math:`\mathcal{N}(m, 1 / (\lambda (h + \delta)))` of every weight.

    An :class:`~pyro.infer.autoguide.AutoGuide` over the latent sites of ``model``: weights
    lifted by :func:`~pyro_bdl.lift` or plain ``pyro.sample`` sites of any shape, in plates
    of constant size. A Normal prior :math:`\mathcal{N}(\mu, \sigma_p^2)` (any of
    :mod:`pyro_bdl.priors`, or ``dist.Normal``) with fixed parameters is IVON's weight
    decay; any other prior, and any support, goes through :math:`\bar\ell` (see the
    module docstring). Sites are sampled as :class:`~pyro_bdl.inference.MeanFieldGuide`
    samples them, so ``Predictive(model, guide=guide)``, :func:`~pyro_bdl.to_arviz` and
    :func:`~pyro_bdl.predict.predict_proba` work as for it; ``median()`` is :math:`T(m)`.
    A site local to a subsampled plate (one value per example) is refused: IVON's update
    is global.

    The means :math:`m` start where ``init_loc_fn`` puts them (the module's weights for
    lifted sites) and :math:`h` at ``hess_init``. The effective sample size is ``ess``
    (:math:`\lambda`), or :math:`N / T` from ``temperature`` (default :math:`T = 1`, the
    Bayesian posterior), :math:`N` being the ``num_data`` of the model's
    ``bdl.observe``. The weight decay of each site is its prior precision per data point,
    :math:`\delta = s / (N \sigma_p^2)` (:math:`s` the site's ``poutine.scale``, usually 1),
    and the prior mean :math:`\mu` pulls :math:`m` as IVON's decay pulls it to 0. Both are
    read from the model when the guide first runs and kept: the posterior does not change
    if the model's prior is changed afterwards.

    :math:`m` and :math:`h` of all sites are two flat ``pyro.param`` vectors
    (``IVONGuide.loc`` and ``IVONGuide.hess``), so that the update touches every weight
    in a few fused element-wise operations; all sites must share a dtype and a device.

    **References**

    [1] Y. Shen, N. Daheim, B. Cong, P. Nickl, G. M. Marconi, C. Bazan, R. Yokota,
    I. Gurevych, D. Cremers, M. E. Khan, T. Möllenhoff, "Variational Learning is
    Effective for Large Deep Networks", ICML 2024, section 2 and Algorithm 1.
    [2] B. Cong et al., "Variational Low-Rank Adaptation Using IVON", 2024.

    Example::

        guide = IVONGuide(model, hess_init=1.0)            # ess = N: the posterior
        fit_ivon(model, guide, train_loader, len(train_set), num_steps=5000, lr=0.1)
        probs = predict_proba(model, test_batch, len(train_set), guide=guide, num_samples=10)

    :param callable model: a Pyro model.
    :param float ess: the effective sample size :math:`\lambda` (default :math:`N / T`).
    :param float temperature: :math:`T > 0`, giving :math:`\lambda = N / T` (pass ``ess``
        or ``temperature``, not both); below 1 a cold posterior.
    :param float hess_init: :math:`h_0 > 0`, where :math:`h` starts.
    :param int num_data: :math:`N`, the data points the likelihood sums over (default:
        the ``num_data`` of the model's ``bdl.observe``; needed if it has none).
    :param callable init_loc_fn: where the means start (default: the module's weights).
    """

    def __init__(
        self,
        model: Callable,
        *,
        ess: float | None = None,
        temperature: float | None = None,
        hess_init: float = 1.0,
        num_data: int | None = None,
        init_loc_fn: Callable = init_to_module,
    ):
        _checks.function("model", model, "a Pyro model (a callable)")
        if ess is not None:
            ess = _checks.real("ess", ess, positive=True)
        if temperature is not None:
            temperature = _checks.real("temperature", temperature, positive=True)
        if ess is not None and temperature is not None:
            raise ValueError(
                f"ess and temperature are two ways to set one thing (ess = N / temperature); "
                f"pass one of them, got ess={ess} and temperature={temperature}"
            )
        self.hess_init = _checks.real("hess_init", hess_init, positive=True)
        if num_data is not None:
            num_data = _checks.integer("num_data", num_data, low=1)
        _checks.function("init_loc_fn", init_loc_fn, "a Pyro init strategy (a callable)")
        super().__init__(model, init_loc_fn=init_loc_fn, temperature=temperature or 1.0)
        self._ess_arg, self._temperature_arg, self._num_data_arg = ess, temperature, num_data
        self.ess: float | None = None
        self.num_data: int | None = None
        #: the names of the model's point weights (``pyro.param`` sites), which IVON leaves
        self.point_sites: list[str] = []

    # -- set-up ------------------------------------------------------------------------

    def _setup_prototype(self, *args, **kwargs) -> None:
        self.point_sites = []
        try:
            super()._setup_prototype(*args, **kwargs)
            self.sites.refuse_local("IVON's update is global")
            self._fixed_priors = self.sites.fixed_priors(self.model, args, kwargs)
            self._read_model(self._observed_num_data)
        except Exception:
            self.prototype_trace = None  # the next call sets up again, not half-way
            raise

    def _prototype_hide_fn(self, msg: dict) -> bool:
        # Pyro's AutoGuide leaves params out of the prototype trace; IVON names the point
        # weights it leaves as they are.
        if msg["type"] == "param":
            self.point_sites.append(msg["name"])
        return super()._prototype_hide_fn(msg)

    def _read_observed(self, observed: list[dict]) -> None:
        # the data-set size N that the observations' plate declares
        trace = pyro.poutine.Trace()
        for msg in observed:
            trace.add_node(msg["name"], **msg)
        self._observed_num_data = observed_num_data(trace)

    def _init_parameters(self, init_locs: dict[str, torch.Tensor]) -> None:
        kinds = {(value.dtype, value.device) for value in init_locs.values()}
        if len(kinds) > 1:
            raise ValueError(
                "IVONGuide keeps the weights in one flat vector, so its sites must share a "
                f"dtype and a device; they have {sorted(map(str, kinds))}: cast the model's "
                "random weights to one dtype (e.g. the head to float32) and place them together"
            )
        self._shapes = {name: value.shape for name, value in init_locs.items()}
        self._sizes = [value.numel() for value in init_locs.values()]
        ends = itertools.accumulate(self._sizes)
        self._slices = {
            name: slice(end - size, end) for name, size, end in zip(init_locs, self._sizes, ends)
        }
        loc = torch.cat([value.reshape(-1) for value in init_locs.values()])
        self.loc = PyroParam(loc, constraints.real)
        self.hess = PyroParam(torch.full_like(loc, self.hess_init), constraints.real)

    def _read_model(self, observed: int | None) -> None:
        """N, the effective sample size, and each site's weight decay and prior mean."""
        if observed is not None and self._num_data_arg not in (None, observed):
            raise ValueError(
                f"num_data={self._num_data_arg} disagrees with the model's bdl.observe, which "
                f"scales its likelihood to num_data={observed}; leave num_data out"
            )
        num_data = self._num_data_arg or observed
        if num_data is None:
            raise ValueError(
                "num_data: the model observes its data without a bdl.observe(..., num_data=N) "
                "plate, so IVON cannot tell the data-set size N: pass num_data=N"
            )
        self.num_data = num_data
        if self._ess_arg is not None:
            self.ess = self._ess_arg
            self.temperature = num_data / self._ess_arg
        else:
            self.temperature = self._temperature_arg or 1.0
            self.ess = num_data / self.temperature
        decays, shifts = [], []
        self.closed_form_priors = set()
        for name, shape in self._shapes.items():
            prior = self.sites.normal_prior(name, self._fixed_priors)
            if prior is None:  # in the loss: decay 0
                decays.append(self.loc.new_zeros(shape.numel()))
                shifts.append(self.loc.new_zeros(shape.numel()))
                continue
            self.closed_form_priors.add(name)
            decay = self.sites[name].message["scale"] / (num_data * prior[1].square())
            decays.append(decay.expand(shape).reshape(-1))
            shifts.append((decay * prior[0]).expand(shape).reshape(-1))
        # One number when every weight has the same decay (an IID prior), else a vector.
        decay = torch.cat(decays)
        self._delta = decay[0].clone() if bool((decay == decay[0]).all()) else decay
        shift = torch.cat(shifts)
        self._prior_shift = shift if bool(shift.any()) else None

    # -- the distribution --------------------------------------------------------------

    def _unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of a flat vector over the weights, one per site, in the sites' shapes."""
        return {
            name: part.view(shape)
            for (name, shape), part in zip(self._shapes.items(), flat.split(self._sizes))
        }

    def _site(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """One site's view of a flat vector (a 0-d tensor stands for every weight)."""
        return flat if flat.dim() == 0 else flat[self._slices[name]].view(self._shapes[name])

    def _loc_and_scale(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        loc = self._site(self.loc, name)
        precision = self._site(self.hess, name) + self._site(self._delta, name)
        return loc, torch.rsqrt(self.ess * precision)

    @property
    def weight_decay(self) -> dict[str, torch.Tensor]:
        r"""Each site's :math:`\delta = s / (N \sigma_p^2)` (a 0-d tensor for an IID prior;
        0 for a site whose prior is not a fixed Normal, see the module docstring)."""
        self._require_setup()
        return {name: self._site(self._delta, name) for name in self._shapes}

    def variational_parameters(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        r"""Site -> mean :math:`m` and site -> Hessian estimate :math:`h`: views of the
        flat ``pyro.param`` vectors ``loc`` and ``hess``."""
        self._require_setup()
        return self._unflatten(self.loc), self._unflatten(self.hess)

    @torch.no_grad()
    def approximation_parameters(self) -> dict[str, torch.Tensor]:
        """Mean, standard deviation and :math:`h` of every site (``"<site>.loc"``,
        ``"<site>.scale"``, ``"<site>.hess"``)."""
        parameters = super().approximation_parameters()
        for name, hess in self._unflatten(self.hess).items():
            parameters[f"{name}.hess"] = hess.detach().clone()
        return parameters

    def _init_settings(self) -> dict:
        return {
            "ess": self._ess_arg,
            "temperature": self._temperature_arg,
            "hess_init": self.hess_init,
            "num_data": self._num_data_arg,
        }

    def _state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        # read from the model at set-up and kept (see the class docstring)
        state = {"ess": self.ess, "temperature": self.temperature, "num_data": self.num_data}
        tensors = {"weight_decay": self._delta}
        if self._prior_shift is not None:
            tensors["prior_shift"] = self._prior_shift
        return state, tensors

    def _restore(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        self.ess, self.temperature = state["ess"], state["temperature"]
        self.num_data = state["num_data"]
        self._delta = tensors["weight_decay"]
        self._prior_shift = tensors.get("prior_shift")

    def hyperparameters(self) -> dict:
        """The guide's settings, JSON-serialisable (for ``bdl.to_arviz``)."""
        if self.ess is None:  # not set up: N, and so ess or T, unknown yet
            return {
                "ess": self._ess_arg,
                "temperature": self._temperature_arg,
                "hess_init": self.hess_init,
                "num_data": self._num_data_arg,
            }
        return {
            "ess": self.ess,
            "temperature": self.temperature,
            "hess_init": self.hess_init,
            "num_data": self.num_data,
        }
