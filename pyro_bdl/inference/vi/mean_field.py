r"""Mean-field Gaussian variational inference: a Normal at every random weight.

Each latent site :math:`\theta_j` of the model gets :math:`q(\theta_j) = \mathcal{N}(m_j,
s_j^2)` elementwise, sampled *at the site itself* (Pyro's ``AutoNormal`` samples an
auxiliary site and puts a ``Delta`` at the model's), so that ``TraceMeanField_ELBO``
uses the closed-form KL from the prior and ``Trace_ELBO`` a Monte Carlo one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from operator import attrgetter

import pyro
import torch
import torch.nn.functional as F
from pyro.distributions import constraints
from pyro.infer.autoguide import AutoGuide
from pyro.infer.autoguide.initialization import InitMessenger
from pyro.infer.autoguide.utils import deep_setattr
from pyro.nn.module import PyroModule, PyroParam

from pyro_bdl.inference.vi.normal import VariationalNormal, check_temperature
from pyro_bdl.lift import init_to_module

__all__ = ["MeanFieldGuide"]

# scale = f(raw) for each parametrisation, with the inverse that sets the initial raw value.
_SCALE_PARAMETRIZATIONS: dict[str, tuple[Callable, Callable[[float], float]]] = {
    "exp": (torch.exp, math.log),
    "softplus": (F.softplus, lambda scale: math.log(math.expm1(scale))),
    "square": (torch.square, math.sqrt),
}


class MeanFieldGuide(AutoGuide):
    r"""A diagonal Gaussian at every latent site, sampled at the site itself.

    .. math::

        q(\theta) = \prod_j \mathcal{N}(\theta_j \mid m_j, s_j^2), \qquad
        s_j = f(\rho_j),

    with the standard deviation parametrised through ``scale_parametrization``: ``"exp"``
    (:math:`\rho = \log s`, the posteriors paper's VI, whose IMDB runs start at
    :math:`\log s = -3`), ``"softplus"`` (:math:`s = \log(1 + e^\rho)`, Bayes by Backprop)
    or ``"square"`` (:math:`s = \rho^2`, BLoB section 3.3). The means start where
    ``init_loc_fn`` puts them: the module's current (pretrained) weights for lifted sites.

    ``temperature`` :math:`T` targets the tempered posterior :math:`p(\theta \mid y)^{1/T}`
    (posteriors paper, section 4): the objective is
    :math:`-\mathbb{E}_q[\log p(y \mid \theta)] + T\, \mathrm{KL}(q \,\|\, p^{1/T})`, see
    :class:`~pyro_bdl.inference.vi.normal.VariationalNormal`. ``stick_the_landing`` drops
    the score term of the Monte Carlo entropy (``Trace_ELBO``), Roeder et al. (2017).

    Sites must be global (outside any plate) with real support, as lifted weights are.

    **References**

    [1] S. Duffield et al., "Scalable Bayesian learning with posteriors", 2024, section 4
        and Appendix D.
    [2] C. Blundell et al., "Weight uncertainty in neural networks", ICML 2015.
    [3] G. Roeder et al., "Sticking the landing", NeurIPS 2017.

    Example::

        guide = MeanFieldGuide(model, temperature=1.0)
        svi = SVI(model, guide, pyro.optim.AdamW({"lr": 1e-3}), TraceMeanField_ELBO())
        for _ in range(num_steps):
            svi.step(next_batch(), num_data)
        probs = predict_proba(model, test_batch, num_data, guide=guide, num_samples=50)

    :param callable model: a Pyro model.
    :param callable init_loc_fn: where the means start (default: the module's weights).
    :param float init_scale: initial standard deviation (default :math:`e^{-3}`).
    :param str scale_parametrization: ``"exp"``, ``"softplus"`` or ``"square"``.
    :param float temperature: :math:`T \ge 0`; 1 is Bayesian, below 1 a cold posterior.
    :param bool stick_the_landing: the sticking-the-landing gradient of the entropy.
    """

    def __init__(
        self,
        model: Callable,
        *,
        init_loc_fn: Callable = init_to_module,
        init_scale: float = math.exp(-3.0),
        scale_parametrization: str = "exp",
        temperature: float = 1.0,
        stick_the_landing: bool = False,
    ):
        if scale_parametrization not in _SCALE_PARAMETRIZATIONS:
            raise ValueError(
                f"scale_parametrization must be one of {sorted(_SCALE_PARAMETRIZATIONS)}, "
                f"got {scale_parametrization!r}"
            )
        if isinstance(init_scale, bool) or not (
            isinstance(init_scale, (int, float)) and init_scale > 0
        ):
            raise ValueError(f"init_scale must be a positive number, got {init_scale!r}")
        self.init_scale = float(init_scale)
        self.scale_parametrization = scale_parametrization
        self.temperature = check_temperature(temperature)
        self.stick_the_landing = bool(stick_the_landing)
        self._scale_fn, self._inverse_scale_fn = _SCALE_PARAMETRIZATIONS[scale_parametrization]
        super().__init__(InitMessenger(init_loc_fn)(model))

    def _setup_prototype(self, *args, **kwargs) -> None:
        # The guide keeps the prototype trace; without no_grad its return value would hold
        # the autograd graph of a whole forward pass, activations included, for good.
        with torch.no_grad():
            super()._setup_prototype(*args, **kwargs)
        self._event_dims = {}
        init_locs = {}
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            _check_site(type(self).__name__, name, site)
            init_locs[name] = site["value"].detach().clone()
            self._event_dims[name] = site["fn"].event_dim
        self._init_parameters(init_locs)

    def _init_parameters(self, init_locs: dict[str, torch.Tensor]) -> None:
        """Register the variational parameters: a mean and a raw scale per site."""
        self.locs = PyroModule()
        self.scale_params = PyroModule()
        for name, init_loc in init_locs.items():
            deep_setattr(self.locs, name, PyroParam(init_loc, constraints.real))
            deep_setattr(
                self.scale_params,
                name,
                PyroParam(self._init_scale_param(init_loc), constraints.real),
            )

    def _init_scale_param(self, init_loc: torch.Tensor) -> torch.Tensor:
        """The initial unconstrained parameter of the standard deviation at one site."""
        return torch.full_like(init_loc, self._inverse_scale_fn(self.init_scale))

    @property
    def site_names(self) -> list[str]:
        """The latent sites this guide samples (after its first call)."""
        self._require_setup()
        return list(self._event_dims)

    def get_posterior(self, name: str) -> torch.distributions.Distribution:
        """The variational distribution of one site, ``VariationalNormal(...).to_event()``."""
        loc, scale = self._loc_and_scale(name)
        normal = VariationalNormal(loc, scale, self.temperature, self.stick_the_landing)
        return normal.to_event(self._event_dims[name])

    def forward(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Draw every latent site from its Gaussian (used by ``SVI`` and ``Predictive``).

        :return: a dict mapping site name to its draw.
        """
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        return {name: pyro.sample(name, self.get_posterior(name)) for name in self._event_dims}

    @torch.no_grad()
    def median(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """The means :math:`m` of every site (the mode and median of a Gaussian)."""
        self._require_setup(*args, **kwargs)
        return {name: self._loc_and_scale(name)[0].detach().clone() for name in self._event_dims}

    @torch.no_grad()
    def quantiles(self, quantiles, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Elementwise quantiles of every site, shaped ``(len(quantiles), *site_shape)``.

        :param quantiles: probabilities in (0, 1), a list or a tensor.
        """
        self._require_setup(*args, **kwargs)
        results = {}
        for name in self._event_dims:
            loc, scale = self._loc_and_scale(name)
            q = torch.as_tensor(quantiles, dtype=loc.dtype, device=loc.device)
            q = q.reshape((-1,) + (1,) * loc.dim())
            results[name] = torch.distributions.Normal(loc, scale).icdf(q)
        return results

    @torch.no_grad()
    def approximation_parameters(self) -> dict[str, torch.Tensor]:
        """Mean and standard deviation of every site, keys ``"<site>.loc"``, ``"<site>.scale"``."""
        self._require_setup()
        parameters = {}
        for name in self._event_dims:
            loc, scale = self._loc_and_scale(name)
            parameters[f"{name}.loc"] = loc.detach().clone()
            parameters[f"{name}.scale"] = scale.detach().clone()
        return parameters

    def hyperparameters(self) -> dict:
        """The guide's settings, JSON-serialisable (for ``bdl.to_arviz``)."""
        return {
            "init_scale": self.init_scale,
            "scale_parametrization": self.scale_parametrization,
            "temperature": self.temperature,
            "stick_the_landing": self.stick_the_landing,
        }

    def variational_parameters(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The trainable tensors: site -> mean :math:`m`, site -> raw scale :math:`\\rho`."""
        self._require_setup()
        locs = {name: attrgetter(name)(self.locs) for name in self._event_dims}
        scale_params = {name: attrgetter(name)(self.scale_params) for name in self._event_dims}
        return locs, scale_params

    def _loc_and_scale(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        loc = attrgetter(name)(self.locs)
        scale = self._scale_fn(attrgetter(name)(self.scale_params))
        return loc, scale

    def _require_setup(self, *args, **kwargs) -> None:
        if self.prototype_trace is None:
            if not args and not kwargs:
                raise RuntimeError(
                    f"{type(self).__name__} has not seen the model yet: call it once with the "
                    "model's arguments (or run an SVI step) first"
                )
            self._setup_prototype(*args, **kwargs)


def _check_site(guide: str, name: str, site: dict) -> None:
    if any(frame.vectorized for frame in site["cond_indep_stack"]):
        raise ValueError(
            f"{guide}: site {name!r} is inside a plate; this guide handles global weights "
            "only (sites outside any plate, as bdl.lift makes them). If it is a likelihood "
            "observed without obs, give the guide its first call (or SVI step) with the data: "
            "the guide's sites are those of that first call"
        )
    support = site["fn"].support
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    if support is not constraints.real:
        raise ValueError(
            f"{guide}: site {name!r} has support {site['fn'].support}; a Normal guide needs "
            "real support (lifted weights have it); reparametrise the site or use "
            "pyro.infer.autoguide.AutoNormal"
        )
