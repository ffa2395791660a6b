r"""Mean-field Gaussian variational inference: a Normal at every random weight.

Each latent site :math:`\theta_j` of the model gets :math:`q(\theta_j) = \mathcal{N}(m_j,
s_j^2)` elementwise, sampled *at the site itself* (Pyro's ``AutoNormal`` samples an
auxiliary site and puts a ``Delta`` at the model's), so that ``TraceMeanField_ELBO``
uses the closed-form KL from the prior and ``Trace_ELBO`` a Monte Carlo one.

The variational parameters of all sites live in one flat tensor per dtype and device
(means, and raw scales), and a draw of every site is one fused expression over it, one
``randn`` for all sites: a guide step costs O(parameters) element-wise work whatever the
number of sites, not a Python loop of small operations per site.

Any latent site of a Pyro model is handled as Pyro's ``AutoNormal`` handles it (see
:mod:`pyro_bdl.inference.sites`): a site with constrained support, or one the model
scales or masks, gets its Normal on the unconstrained value at an auxiliary site
``<name>_unconstrained``, and the site itself the ``Delta`` of :math:`x = T(z)` with the
log-Jacobian; sites in plates are sampled inside the same plates, and a site local to a
subsampled plate keeps one Gaussian per example, of which each step uses the plate's
subsample.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.distributions import constraints
from pyro.infer.autoguide import AutoGuide
from pyro.infer.autoguide.initialization import InitMessenger
from pyro.nn.module import PyroModule, PyroParam
from pyro.ops.tensor_utils import periodic_repeat
from torch.distributions import kl

from pyro_bdl._checks import function, instance, one_of, real
from pyro_bdl.inference.guide_state import GuideState
from pyro_bdl.inference.sites import LatentSites
from pyro_bdl.inference.vi.normal import VariationalNormal, check_temperature, tempered_kl
from pyro_bdl.lift import init_to_module

__all__ = ["MeanFieldGuide"]

# scale = f(raw) for each parametrisation, with the inverse that sets the initial raw value.
_SCALE_PARAMETRIZATIONS: dict[str, tuple[Callable, Callable[[float], float]]] = {
    "exp": (torch.exp, math.log),
    "softplus": (F.softplus, lambda scale: math.log(math.expm1(scale))),
    "square": (torch.square, math.sqrt),
}


@dataclass
class _Group:
    """Sites of one dtype and device, stored end to end in one flat tensor."""

    names: list[str]
    shapes: list[torch.Size]
    event_dims: list[int]

    @property
    def sizes(self) -> list[int]:
        return [shape.numel() for shape in self.shapes]

    def split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per site, a view of ``flat`` (``(..., total)``) shaped like the site."""
        lead = flat.shape[:-1]
        parts = flat.split(self.sizes, -1)
        return {
            name: part.view(lead + shape)
            for name, part, shape in zip(self.names, parts, self.shapes)
        }


class _DrawnNormal(VariationalNormal):
    """A site's Normal whose draw was made by the guide's fused draw of all sites.

    ``rsample()`` returns that draw (a sample of this very distribution, made in one
    expression with the other sites'); any other sample shape samples afresh.
    """

    def __init__(self, loc, scale, temperature, stick_the_landing, draw):
        super().__init__(loc, scale, temperature, stick_the_landing, validate_args=False)
        self._draw = draw

    def rsample(self, sample_shape=()):
        if not sample_shape:
            return self._draw
        return super().rsample(sample_shape)

    def expand(self, batch_shape, _instance=None):
        # an expanded distribution (a vectorised particle plate) samples afresh
        plain = VariationalNormal(self.loc, self.scale, self.temperature, self.stick_the_landing)
        return plain.expand(batch_shape, _instance)


class _TransformedDelta(dist.Delta):
    r"""The ``Delta`` at :math:`x = T(z)` of a site whose Normal is on :math:`z`.

    Its log density, :math:`T \log|\partial z / \partial x|`, makes the guide's density
    that of :math:`x`. Pyro computes the KL of a ``Delta`` from a prior as
    :math:`-\log p(x)`, leaving the log density and the model site's scale out; this class
    has no KL, so that ``TraceMeanField_ELBO`` scores the site by Monte Carlo, exactly.
    """


# Pyro registers its Delta's KL against Pyro's Distribution mixin: both bases, or the
# dispatch between the two registrations is ambiguous.
@kl.register_kl(_TransformedDelta, torch.distributions.Distribution)
@kl.register_kl(_TransformedDelta, dist.Distribution)
def _no_closed_form(p, q):
    raise NotImplementedError


class MeanFieldGuide(GuideState, AutoGuide):
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

    Any latent site works, as in Pyro's ``AutoNormal``: of any shape, with any support
    (the Normal is on the unconstrained value :math:`z` of :math:`x = T(z)`, ``median()``
    and ``quantiles()`` are returned in the site's support), inside plates, local to a
    subsampled plate, scaled or masked by the model. A real site the model counts once
    is sampled at the site itself with a closed-form KL; the others through an auxiliary
    site ``<name>_unconstrained`` (see the module docstring).

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
        function("model", model, "a Pyro model (a callable)")
        function("init_loc_fn", init_loc_fn, "a Pyro init strategy (a callable)")
        one_of("scale_parametrization", scale_parametrization, _SCALE_PARAMETRIZATIONS)
        self.init_scale = real("init_scale", init_scale, positive=True)
        self.scale_parametrization = scale_parametrization
        self.temperature = check_temperature(temperature)
        self.stick_the_landing = instance(
            "stick_the_landing", stick_the_landing, bool, "True or False"
        )
        self._scale_fn, self._inverse_scale_fn = _SCALE_PARAMETRIZATIONS[scale_parametrization]
        super().__init__(InitMessenger(init_loc_fn)(model))

    def _setup_prototype(self, *args, **kwargs) -> None:
        # The guide keeps the prototype trace; without no_grad its return value would hold
        # the autograd graph of a whole forward pass, activations included, for good.
        with torch.no_grad():
            super()._setup_prototype(*args, **kwargs)
        self.sites = LatentSites(self.prototype_trace, type(self).__name__)
        self._event_dims = {name: site.event_dim for name, site in self.sites.items()}
        # Sampled through an auxiliary site: a constrained support (a Delta at T(z) carries
        # the Jacobian), or a model site whose log density the plates alone do not scale
        # (the closed-form KL would be counted at the guide's scale, not the model's).
        self._auxiliary = {
            name for name, site in self.sites.items() if not (site.is_real and site.unscaled)
        }
        unconstrained = self.sites.unconstrain(
            {name: site.message["value"].detach() for name, site in self.sites.items()}
        )
        init_locs = {}
        for name, site in self.sites.items():
            init_loc = unconstrained[name].clone()
            for frame in site.subsampled_frames:  # one Gaussian per example of the plate
                dim = frame.dim - site.event_dim
                init_loc = periodic_repeat(init_loc, frame.full_size, dim).contiguous()
            init_locs[name] = init_loc
        self._groups = None
        self._init_parameters(init_locs)

    def _init_parameters(self, init_locs: dict[str, torch.Tensor]) -> None:
        """Register the variational parameters: the means and raw scales of all sites, flat.

        One pair of flat tensors per dtype and device. A subclass that keeps other
        parameters overrides this and :meth:`_loc_and_scale` (draws are then per site).
        """
        groups: dict[tuple, tuple[_Group, list, list]] = {}
        for name, init_loc in init_locs.items():
            key = (init_loc.dtype, init_loc.device)
            if key not in groups:
                groups[key] = (_Group([], [], []), [], [])
            group, locs, scales = groups[key]
            group.names.append(name)
            group.shapes.append(init_loc.shape)
            group.event_dims.append(self._event_dims[name])
            locs.append(init_loc.reshape(-1))
            scales.append(self._init_scale_param(init_loc).reshape(-1))
        self._groups = [group for group, _, _ in groups.values()]
        self.locs = PyroModule()
        self.scale_params = PyroModule()
        for k, (_, locs, scales) in enumerate(groups.values()):
            setattr(self.locs, f"group{k}", PyroParam(torch.cat(locs), constraints.real))
            setattr(self.scale_params, f"group{k}", PyroParam(torch.cat(scales), constraints.real))

    def _init_scale_param(self, init_loc: torch.Tensor) -> torch.Tensor:
        """The initial unconstrained parameter of the standard deviation at one site."""
        return torch.full_like(init_loc, self._inverse_scale_fn(self.init_scale))

    @property
    def site_names(self) -> list[str]:
        """The latent sites this guide samples (after its first call)."""
        self._require_setup()
        return list(self._event_dims)

    def flat_parameters(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The trainable leaves: per dtype and device, the flat means and raw scales.

        Optimisers take these (two tensors for any number of sites).
        """
        self._require_setup()
        if self._groups is None:
            raise TypeError(f"{type(self).__name__} keeps its own parameters, not flat ones")
        return [
            (getattr(self.locs, f"group{k}"), getattr(self.scale_params, f"group{k}"))
            for k in range(len(self._groups))
        ]

    def variational_parameters(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Site -> mean :math:`m` and site -> raw scale :math:`\\rho`: views of the flat leaves.

        The views share storage with :meth:`flat_parameters`, so they follow every update
        and writing into them (under ``torch.no_grad()``) sets the guide.
        """
        locs, scale_params = {}, {}
        for group, (loc, raw) in zip(self._groups, self.flat_parameters()):
            locs.update(group.split(loc))
            scale_params.update(group.split(raw))
        return locs, scale_params

    def draw(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
        """One draw of every site's unconstrained value, fused: per group one ``randn``.

        :return: site -> draw, site -> mean, site -> standard deviation (views), each of
            the site's unconstrained shape (every example, for a site local to a
            subsampled plate).
        """
        if self._groups is None:  # a subclass's own parameters: one draw per site
            locs, scales = self._locs_and_scales()
            draws = {name: torch.addcmul(loc, scales[name], torch.randn_like(loc))
                     for name, loc in locs.items()}  # fmt: skip
            return draws, locs, scales
        draws, locs, scales = {}, {}, {}
        for group, (loc, raw) in zip(self._groups, self.flat_parameters()):
            scale = self._scale_fn(raw)
            draw = torch.addcmul(loc, scale, torch.randn_like(loc))
            draws.update(group.split(draw))
            locs.update(group.split(loc))
            scales.update(group.split(scale))
        return draws, locs, scales

    def kl(self, priors: dict[str, torch.distributions.Distribution]) -> torch.Tensor:
        """The closed-form KL of every site from its Normal prior, in one fused expression.

        The (tempered) KL of :class:`~pyro_bdl.inference.vi.normal.VariationalNormal`,
        summed over all sites: what ``TraceMeanField_ELBO`` adds up site by site.

        :param dict priors: site -> its prior (an independent Normal, as ``bdl.lift``
            gives), e.g. the ``fn`` of the model's sample sites.
        """
        auxiliary = sorted(self._auxiliary)
        if auxiliary:
            raise ValueError(
                f"the site {auxiliary[0]!r} has a constrained support or a scale of its own "
                "in the model, so its KL has no closed form"
            )
        total = 0.0
        prior_locs, prior_scales = self._flat_priors(priors)
        for (loc, raw), prior_loc, prior_scale in zip(
            self.flat_parameters(), prior_locs, prior_scales
        ):
            scale = self._scale_fn(raw)
            total = total + tempered_kl(loc, scale, prior_loc, prior_scale, self.temperature).sum()
        return total

    def _flat_priors(self, priors: dict) -> tuple[list, list]:
        """The priors' means and scales laid out as the flat parameters (cached per prior)."""
        fns = [priors[name] for group in self._groups for name in group.names]
        cached = getattr(self, "_prior_cache", None)
        if cached is not None and all(a is b for a, b in zip(cached[0], fns)):
            return cached[1]
        locs, scales = [], []
        for group in self._groups:
            parts = [_normal_parts(name, priors[name], shape)
                     for name, shape in zip(group.names, group.shapes)]  # fmt: skip
            locs.append(torch.cat([loc for loc, _ in parts]))
            scales.append(torch.cat([scale for _, scale in parts]))
        self._prior_cache = (fns, (locs, scales))
        return locs, scales

    def get_posterior(self, *args, **kwargs) -> torch.distributions.Distribution:
        """The variational distribution of the flat unconstrained latent vector, as
        Pyro's ``AutoContinuous`` guides give it: every site's unconstrained value
        flattened, end to end in the model's order, under
        ``VariationalNormal(loc, scale).to_event(1)`` (its samples and density those of
        ``AutoDiagonalNormal.get_posterior()``).

        ``get_posterior(name)`` (or ``name=...``), a site's name alone, is this guide's
        older form: the distribution of that site's unconstrained value, shaped like the
        site, ``VariationalNormal(...).to_event()``. A model whose first argument is a
        string passes it by keyword.

        Example::

            posterior = guide.get_posterior(batch, num_data)    # the model's arguments
            site = guide.get_posterior("net.0.weight")          # one site

        :param args: the model's arguments (read if the guide has not seen the model
            yet), or one site's name.
        """
        if not args and len(kwargs) == 1 and isinstance(kwargs.get("name"), str):
            args, kwargs = (kwargs["name"],), {}  # the older form's keyword, name=...
        if args and isinstance(args[0], str):
            if len(args) > 1 or kwargs:
                raise TypeError(
                    f"get_posterior({args[0]!r}, ...): a site's name comes alone; pass the "
                    "model's arguments without it, a string argument of the model by keyword"
                )
            return self._site_posterior(args[0])
        self._require_setup(*args, **kwargs)
        locs, scales = self._locs_and_scales()
        return self._normal(self.sites.pack(locs), self.sites.pack(scales), 1)

    def _site_posterior(self, name: str) -> torch.distributions.Distribution:
        event_dims = getattr(self, "_event_dims", {})  # set when the guide reads the model
        if name not in event_dims:
            raise KeyError(
                f"get_posterior: {name!r} is not a latent site of the model {list(event_dims)}"
            )
        return self._normal(*self._loc_and_scale(name), event_dims[name])

    def _normal(self, loc, scale, event_dim: int) -> torch.distributions.Distribution:
        normal = VariationalNormal(loc, scale, self.temperature, self.stick_the_landing)
        return normal.to_event(event_dim)

    def forward(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Draw every latent site from its Gaussian (used by ``SVI`` and ``Predictive``).

        :return: a dict mapping site name to its draw, in the site's support.
        """
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        plates = self._create_plates(*args, **kwargs)
        draws, locs, scales = self.draw()
        result = {}
        for name, site in self.sites.items():
            with ExitStack() as stack:
                loc, scale, draw = locs[name], scales[name], draws[name]
                for frame in site.frames:
                    indices = stack.enter_context(plates[frame.name])
                    if frame in site.subsampled_frames:  # this step's examples
                        dim = frame.dim - site.event_dim
                        loc, scale, draw = (
                            t.index_select(dim, indices) for t in (loc, scale, draw)
                        )
                normal = _DrawnNormal(loc, scale, self.temperature, self.stick_the_landing, draw)
                normal = normal.to_event(site.event_dim)
                if name not in self._auxiliary:
                    result[name] = pyro.sample(name, normal)
                    continue
                z = pyro.sample(f"{name}_unconstrained", normal, infer={"is_auxiliary": True})
                result[name] = pyro.sample(
                    name, site.delta(z, self.temperature, cls=_TransformedDelta)
                )
        return result

    @torch.no_grad()
    def median(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Every site at the mean :math:`m` of its Gaussian, in the site's support (the
        median of each entry, as Pyro's ``AutoNormal`` returns)."""
        self._require_setup(*args, **kwargs)
        locs, _ = self._locs_and_scales()
        values, _ = self.sites.constrain({name: loc.detach() for name, loc in locs.items()})
        return {name: value.clone() for name, value in values.items()}

    @torch.no_grad()
    def quantiles(self, quantiles, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Elementwise quantiles of every site in its support, ``(len(quantiles), *shape)``.

        :param quantiles: probabilities in (0, 1), a list or a tensor.
        """
        self._require_setup(*args, **kwargs)
        results = {}
        locs, scales = self._locs_and_scales()
        for name, loc in locs.items():
            q = torch.as_tensor(quantiles, dtype=loc.dtype, device=loc.device)
            q = q.reshape((-1,) + (1,) * loc.dim())
            values = torch.distributions.Normal(loc, scales[name]).icdf(q)
            results[name] = self.sites[name].transform(values)
        return results

    @torch.no_grad()
    def stddevs(self) -> torch.Tensor:
        """Every site's posterior standard deviation in one flat CPU vector (sites in order).

        Whether training moved the scales (a temperature acted, a KL widened the
        posterior) shows in its mean against the starting scale::

            float(guide.stddevs().mean())
        """
        self._require_setup()
        _, scales = self._locs_and_scales()
        return torch.cat([scale.detach().flatten().cpu() for scale in scales.values()])

    @torch.no_grad()
    def approximation_parameters(self) -> dict[str, torch.Tensor]:
        """Mean and standard deviation of every site, keys ``"<site>.loc"``, ``"<site>.scale"``
        (of the unconstrained value where the site's support is constrained)."""
        self._require_setup()
        parameters = {}
        locs, scales = self._locs_and_scales()
        for name, loc in locs.items():
            scale = scales[name]
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

    def _init_settings(self) -> dict:
        # the constructor's arguments, for bdl.save and load_state_dict (GuideState)
        return self.hyperparameters()

    def _locs_and_scales(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        if self._groups is None:
            pairs = {name: self._loc_and_scale(name) for name in self._event_dims}
            return {n: p[0] for n, p in pairs.items()}, {n: p[1] for n, p in pairs.items()}
        locs, scales = {}, {}
        for group, (loc, raw) in zip(self._groups, self.flat_parameters()):
            locs.update(group.split(loc))
            scales.update(group.split(self._scale_fn(raw)))
        return locs, scales

    def _loc_and_scale(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        locs, scales = self._locs_and_scales()
        return locs[name], scales[name]

    def _ensure_setup(self, *args, **kwargs) -> None:
        """Read the model on these arguments if the guide has not yet (a training step's
        first call; a model whose data are in a closure takes none)."""
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)

    def _require_setup(self, *args, **kwargs) -> None:
        if self.prototype_trace is None:
            if not args and not kwargs:
                raise RuntimeError(
                    f"{type(self).__name__} has not seen the model yet: call it once with the "
                    "model's arguments (or run an SVI step) first"
                )
            self._setup_prototype(*args, **kwargs)


def _normal_parts(name: str, fn, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat mean and scale of a site's independent Normal prior."""
    base = fn
    while isinstance(base, (torch.distributions.Independent, dist.ExpandedDistribution)):
        base = base.base_dist
    if not isinstance(base, torch.distributions.Normal):
        raise ValueError(
            f"the prior of {name!r} is a {type(fn).__name__}, which has no closed-form KL from a "
            "Normal; this needs a Normal prior (e.g. bdl.priors.IIDNormal)"
        )
    return base.loc.expand(shape).reshape(-1), base.scale.expand(shape).reshape(-1)
