r"""The Normal that the variational guides sample each weight from.

A guide's site enters the ELBO through two numbers: the log density of its draw (for
``Trace_ELBO``) and its KL divergence from the prior (for ``TraceMeanField_ELBO``).
:class:`VariationalNormal` samples like ``Normal(loc, scale)`` and makes both numbers
those of the tempered objective of the posteriors paper (section 4, Appendix A.2)

.. math::

    \mathrm{NELBO}_T = -\mathbb{E}_q[\log p(y \mid \theta)] - \mathbb{E}_q[\log p(\theta)]
        + T\, \mathbb{E}_q[\log q(\theta)]
      = -\mathbb{E}_q[\log p(y \mid \theta)] + T\, \mathrm{KL}(q \,\|\, p^{1/T}) + c,

whose minimiser is the tempered posterior :math:`p(\theta \mid y)^{1/T}`: the KL is scaled
by :math:`T` and the prior tempered to :math:`p^{1/T}` (for a Normal prior, its variance
multiplied by :math:`T`). :math:`T = 1` is the usual ELBO and the KL is eq. 11 of the BLoB
paper; :math:`T = 0` drops the entropy (a point estimate).

With ``stick_the_landing`` the log density of a draw is evaluated with the parameters
detached, so its gradient flows only through the draw (Roeder et al. 2017); the closed
form KL has no Monte Carlo term for it to act on.
"""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
from torch.distributions import kl

from pyro_bdl._checks import instance, real

__all__ = ["VariationalNormal", "tempered_kl"]

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


class VariationalNormal(dist.Normal):
    r"""``Normal(loc, scale)`` whose ELBO terms are tempered by ``temperature``.

    ``log_prob(x)`` is :math:`T \log q(x)`; ``kl_divergence(q, p)`` against a Normal prior is
    the closed form of :math:`\mathbb{E}_q[-\log p] - T\, H(q)`. Sampling, ``mean``,
    ``entropy`` and ``icdf`` are the Normal's own.

    Example::

        q = VariationalNormal(loc, scale, temperature=0.5).to_event(2)
        theta = pyro.sample("w", q)

    :param torch.Tensor loc: mean.
    :param torch.Tensor scale: standard deviation (positive).
    :param float temperature: :math:`T \ge 0`.
    :param bool stick_the_landing: evaluate ``log_prob`` with detached parameters.
    """

    def __init__(
        self,
        loc: torch.Tensor,
        scale: torch.Tensor,
        temperature: float = 1.0,
        stick_the_landing: bool = False,
        validate_args: bool | None = None,
    ):
        self.temperature = check_temperature(temperature)
        self.stick_the_landing = instance(
            "stick_the_landing", stick_the_landing, bool, "True or False"
        )
        super().__init__(loc, scale, validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(VariationalNormal, _instance)
        new = super().expand(batch_shape, _instance=new)
        new.temperature = self.temperature
        new.stick_the_landing = self.stick_the_landing
        return new

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if self.stick_the_landing:
            log_q = dist.Normal(self.loc.detach(), self.scale.detach()).log_prob(value)
        else:
            log_q = super().log_prob(value)
        return log_q if self.temperature == 1.0 else self.temperature * log_q


def check_temperature(temperature: float) -> float:
    """The temperature as a float, or an error naming it."""
    return real("temperature", temperature, non_negative=True)


def tempered_kl(
    loc: torch.Tensor,
    scale: torch.Tensor,
    prior_loc: torch.Tensor,
    prior_scale: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    r""":math:`\mathbb{E}_q[-\log p] - T\, H(q)` elementwise, for :math:`q = \mathcal{N}(m, s^2)`.

    The KL of :class:`VariationalNormal` against a Normal prior; a guide calls it once on
    the flat tensors of all its sites (one fused expression for any number of sites).
    """
    # Written out rather than calling torch's Normal-Normal KL because the tempered
    # objective needs the cross entropy and the entropy apart:
    # E_q[-log p] = log sigma_p + (s^2 + (m - mu_p)^2) / (2 sigma_p^2) + log(2 pi) / 2,
    # H(q) = log s + 1/2 + log(2 pi) / 2. At T = 1 their difference is eq. 11 of BLoB.
    cross_entropy = (
        prior_scale.log()
        + (scale.square() + (loc - prior_loc).square()) / (2 * prior_scale.square())
    ) + _HALF_LOG_2PI
    entropy = scale.log() + 0.5 + _HALF_LOG_2PI
    return cross_entropy - temperature * entropy


@kl.register_kl(VariationalNormal, torch.distributions.Normal)
def _kl_variational_normal(q: VariationalNormal, p: torch.distributions.Normal) -> torch.Tensor:
    return tempered_kl(q.loc, q.scale, p.loc, p.scale, q.temperature)
