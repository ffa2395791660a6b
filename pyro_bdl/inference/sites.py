r"""The latent sites of a Pyro model, packed in the unconstrained space every guide uses.

Pyro's autoguides (``AutoNormal``, ``AutoContinuous``, ``AutoLaplaceApproximation``)
put their Gaussians on unconstrained values: a site with support :math:`S` takes the
value :math:`x = T(z)`, :math:`T` = ``biject_to(S)``, of a real tensor :math:`z`, and a
density :math:`q(z)` is the density

.. math:: q(x) = q(z)\, \Big|\frac{\partial z}{\partial x}\Big|

over the site. :class:`LatentSites` reads the latent sites of a prototype trace once and
answers what every guide of pyro_bdl asks of them (mean-field, IVON and Laplace share it):
their shapes and plates, :math:`T`, the unconstrained values and back, the log-Jacobian
:math:`\log|\partial x / \partial z|`, a flat vector over all of them, and which priors
are Normals fixed in the other latent sites (the closed forms of IVON's weight decay and
of the Laplace prior precision need one). Where a site has real support :math:`T` is the
identity and costs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.distributions.transforms import biject_to
from pyro.distributions.util import sum_rightmost
from pyro.infer.autoguide.utils import helpful_support_errors
from pyro.poutine.indep_messenger import CondIndepStackFrame
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample

from pyro_bdl._checks import is_real
from pyro_bdl.priors import normal_parameters

__all__ = ["LatentSite", "LatentSites", "is_real", "prior_family"]


@dataclass
class LatentSite:
    """One latent site of the prototype trace.

    :ivar str name: the site's name.
    :ivar torch.Size shape: the shape of its value (plate dimensions included).
    :ivar transform: :math:`T` = ``biject_to(support)``.
    :ivar torch.Size unconstrained_shape: the shape of :math:`z`.
    :ivar int event_dim: the event dimensions of :math:`z`.
    :ivar tuple frames: the vectorised plates around the site.
    :ivar dict message: the site's message in the prototype trace.
    """

    name: str
    shape: torch.Size
    transform: torch.distributions.Transform
    unconstrained_shape: torch.Size
    event_dim: int
    frames: tuple[CondIndepStackFrame, ...]
    message: dict

    @property
    def is_real(self) -> bool:
        """Whether :math:`T` is the identity (real support)."""
        return is_real(self.message["fn"].support)

    @property
    def prior_name(self) -> str:
        """The name of the prior's distribution (inside ``Independent`` and ``expand``)."""
        return prior_family(self.message["fn"])

    @property
    def numel(self) -> int:
        """Entries of :math:`z`."""
        return math.prod(self.unconstrained_shape)

    @property
    def subsampled_frames(self) -> list[CondIndepStackFrame]:
        """The plates around the site that subsample (a local latent of a minibatch)."""
        return [f for f in self.frames if f.full_size is not None and f.full_size != f.size]

    def delta(
        self, z: torch.Tensor, temperature: float = 1.0, extra: float | torch.Tensor = 0.0, cls=None
    ) -> dist.Delta:
        """The ``Delta`` at :math:`x = T(z)` that a guide samples at the site.

        Its log density is :math:`T \\log|\\partial z / \\partial x|` per element of the
        site's batch (as Pyro's ``AutoNormal`` and ``AutoContinuous`` have it, tempered by
        ``temperature``), plus ``extra`` spread evenly over those elements, so that
        ``extra`` counts once per draw.

        :param z: the unconstrained value, draw dimensions in front.
        :param cls: the ``Delta`` class to build (default ``pyro.distributions.Delta``).
        """
        cls = cls or dist.Delta
        event_dim = self.message["fn"].event_dim
        batch = self.shape[: len(self.shape) - event_dim]
        log_density = extra / math.prod(batch) if batch else extra
        if self.is_real:
            return cls(z, log_density=log_density, event_dim=event_dim)
        x = self.transform(z)
        if pyro.poutine.get_mask() is not False:
            jacobian = self.transform.inv.log_abs_det_jacobian(x, z)
            jacobian = sum_rightmost(jacobian, jacobian.dim() - x.dim() + event_dim)
            log_density = log_density + temperature * jacobian
        return cls(x, log_density=log_density, event_dim=event_dim)

    @property
    def unscaled(self) -> bool:
        """Whether the model counts the site's log density once (no scale, no mask)."""
        scale = self.message["scale"]
        return self.message["mask"] is None and not torch.is_tensor(scale) and scale == 1.0


class LatentSites(Mapping[str, LatentSite]):
    """The latent sites of a prototype trace, in its order, with their transforms.

    Example::

        sites = LatentSites(guide.prototype_trace, "MeanFieldGuide")
        z = sites.unconstrain({name: site.message["value"] for name, site in sites.items()})
        flat = sites.pack(z)                       # (d,), every site end to end
        values, log_det = sites.constrain(sites.unpack(flat))

    :param trace: a prototype trace (latent sample sites; others are skipped).
    :param str owner: the guide's name, for error messages.
    """

    def __init__(self, trace: pyro.poutine.Trace, owner: str):
        self.owner = owner
        self._sites: dict[str, LatentSite] = {}
        for name, message in trace.nodes.items():
            if message["type"] != "sample" or message["is_observed"] or site_is_subsample(message):
                continue
            fn, value = message["fn"], message["value"]
            with helpful_support_errors(message):
                transform = biject_to(fn.support)
                unconstrained = transform.inv(value.detach())
            for frame in message["cond_indep_stack"]:
                if not frame.vectorized:
                    raise ValueError(
                        f"{owner}: site {name!r} is inside the sequential plate "
                        f"{frame.name!r}; Pyro's autoguides and this guide need vectorised "
                        "plates (with pyro.plate(...) as a context manager)"
                    )
            self._sites[name] = LatentSite(
                name=name,
                shape=value.shape,
                transform=transform,
                unconstrained_shape=unconstrained.shape,
                event_dim=fn.event_dim + unconstrained.dim() - value.dim(),
                frames=tuple(message["cond_indep_stack"]),
                message=message,
            )

    @classmethod
    def real(cls, values: Mapping[str, torch.Tensor], owner: str) -> LatentSites:
        """Real sites of these values' shapes, outside plates, every dimension an event
        dimension: the sites of a guide restored from a state without its model's trace."""
        sites = cls(pyro.poutine.Trace(), owner)
        for name, value in values.items():
            fn = dist.ImproperUniform(constraints.real, torch.Size(), value.shape)
            message = {"fn": fn, "value": value, "scale": 1.0, "mask": None}
            transform = biject_to(constraints.real)
            sites._sites[name] = LatentSite(
                name, value.shape, transform, value.shape, value.dim(), (), message
            )
        return sites

    def __getitem__(self, name: str) -> LatentSite:
        return self._sites[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sites)

    def __len__(self) -> int:
        return len(self._sites)

    @property
    def numel(self) -> int:
        """Entries of all the unconstrained values together."""
        return sum(site.numel for site in self._sites.values())

    @property
    def all_real(self) -> bool:
        """Whether every site has real support (every transform is the identity)."""
        return all(site.is_real for site in self._sites.values())

    def refuse_local(self, why: str) -> None:
        """Refuse, by name, a site local to a subsampled plate (a latent per example).

        :param str why: what needs global sites, for the message.
        """
        for name, site in self._sites.items():
            frames = site.subsampled_frames
            if frames:
                raise ValueError(
                    f"{self.owner}: site {name!r} is local to the subsampled plate "
                    f"{frames[0].name!r} (one value per example, {frames[0].size} of "
                    f"{frames[0].full_size} drawn per step); {why}. Use MeanFieldGuide, "
                    "or Pyro's AutoNormal, which learn one Gaussian per example"
                )

    def unconstrain(self, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """:math:`z = T^{-1}(x)` for every site."""
        return {
            name: value if site.is_real else site.transform.inv(value)
            for (name, site), value in zip(self._sites.items(), _ordered(values, self._sites))
        }

    def constrain(
        self, unconstrained: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | float]:
        """:math:`x = T(z)` for every site and :math:`\\sum \\log|\\partial x / \\partial z|`.

        :param dict unconstrained: site -> :math:`z`, shaped like the site's
            unconstrained value (no leading draw dimensions).
        :return: site -> :math:`x`, and the summed log-Jacobian (0.0 if every site is real).
        """
        values, log_det = {}, 0.0
        for (name, site), z in zip(self._sites.items(), _ordered(unconstrained, self._sites)):
            if site.is_real:
                values[name] = z
                continue
            values[name] = x = site.transform(z)
            log_det = log_det + site.transform.log_abs_det_jacobian(z, x).sum()
        return values, log_det

    def pack(self, unconstrained: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Every site's :math:`z` end to end in one flat vector ``(d,)``."""
        return torch.cat([z.reshape(-1) for z in _ordered(unconstrained, self._sites)])

    def unpack(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The inverse of :meth:`pack`: views of ``flat`` (``(..., d)``) per site."""
        lead = flat.shape[:-1]
        parts = flat.split([site.numel for site in self._sites.values()], -1)
        return {
            name: part.reshape(lead + site.unconstrained_shape)
            for (name, site), part in zip(self._sites.items(), parts)
        }

    def fixed_priors(self, model: Callable, args: tuple, kwargs: dict) -> set[str]:
        """The sites whose prior does not depend on the other latent sites.

        Runs ``model`` with the prototype's values as leaves that require gradients and
        asks, at each latent site, whether the log density of its prior (at its own value,
        detached) has a gradient in the latent sites sampled before it; a hierarchical
        prior (eight schools' ``theta ~ Normal(mu, tau)``) has. The run stops once the
        last latent site is sampled, so a network's forward pass after its weights (as
        :func:`pyro_bdl.lift` runs it) is never made.
        """
        recorder = _PriorDependence({name: s.message["value"] for name, s in self._sites.items()})
        with torch.enable_grad(), pyro.poutine.block():
            try:
                with recorder:
                    model(*args, **kwargs)
            except _AllSampled:
                pass
        return set(self._sites) - recorder.dependent

    def normal_prior(self, name: str, fixed: set[str]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (loc, scale) of a site's prior if it is an independent Normal on a real
        site, fixed in the other latent sites (``fixed`` from :meth:`fixed_priors`) and
        unmasked; None otherwise. The site's ``poutine.scale`` is the caller's to read."""
        site = self._sites[name]
        if name not in fixed or not site.is_real or site.message["mask"] is not None:
            return None
        return normal_parameters(site.message["fn"], site.message["value"])


def prior_family(fn: torch.distributions.Distribution) -> str:
    """The name of a site's distribution inside ``Independent``, ``expand`` and ``mask``
    (``"Normal"`` for ``Normal(0, 1).expand([3]).to_event(1)``)."""
    while isinstance(fn, (dist.Independent, dist.ExpandedDistribution, dist.MaskedDistribution)):
        fn = fn.base_dist
    return type(fn).__name__


def _ordered(values: Mapping[str, torch.Tensor], sites: Mapping[str, LatentSite]):
    try:
        return [values[name] for name in sites]
    except KeyError as error:
        raise KeyError(f"no value for the latent site {error.args[0]!r}") from None


class _AllSampled(Exception):
    """Raised once the last latent site is sampled: the rest of the model is not needed."""


class _PriorDependence(Messenger):
    """Latent sites at given values, as leaves; records whose prior depends on earlier ones."""

    def __init__(self, values: Mapping[str, torch.Tensor]):
        super().__init__()
        self.values = values
        self.leaves: dict[str, torch.Tensor] = {}
        self.dependent: set[str] = set()

    def _pyro_sample(self, msg: dict) -> None:
        if msg["name"] in self.values and not msg["is_observed"]:
            msg["value"] = self.values[msg["name"]].detach().requires_grad_()
            msg["is_observed"] = True
            msg["infer"] = {**msg["infer"], "_bdl_latent": True}

    def _pyro_post_sample(self, msg: dict) -> None:
        if not msg["infer"].get("_bdl_latent"):
            return
        if self.leaves:
            log_prob = msg["fn"].log_prob(msg["value"].detach())
            if log_prob.requires_grad:
                grads = torch.autograd.grad(
                    log_prob.sum(), list(self.leaves.values()), allow_unused=True
                )
                if any(grad is not None for grad in grads):
                    self.dependent.add(msg["name"])
        self.leaves[msg["name"]] = msg["value"]
        if len(self.leaves) == len(self.values):
            raise _AllSampled
