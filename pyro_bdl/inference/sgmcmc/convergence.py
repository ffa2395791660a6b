"""A finished chain's split R-hat and bulk ESS, from a few coordinates kept on the way.

Each kept draw records up to ``COORDINATES_PER_SITE`` coordinates of every site (all of
a smaller site; otherwise a fixed random choice, the same for every draw), read from the
device together with the draw's statistics, so the check costs nothing per step and a
few numbers per draw, however large the model. When the chain ends, the rank-normalised
split R-hat (the chain cut in halves, as ArviZ and Pyro cut each chain) and the bulk
ESS of :mod:`pyro_bdl.diagnostics` are computed on them; both are invariant under the
monotone maps between a constrained site and its unconstrained coordinates.
"""

from __future__ import annotations

import numpy as np
import torch

from pyro_bdl.diagnostics import ess_bulk, rhat

__all__ = ["ConvergenceMonitor", "MAX_RHAT", "MIN_ESS", "COORDINATES_PER_SITE"]

#: Split R-hat above this is a warning (Vehtari et al. 2021).
MAX_RHAT = 1.01
#: Bulk ESS below this is a warning: posterior means then carry a Monte Carlo error over
#: a tenth of a posterior standard deviation.
MIN_ESS = 100
#: Coordinates of each site that are followed.
COORDINATES_PER_SITE = 8
#: Fewest kept draws the diagnostics are defined for.
_MIN_DRAWS = 4


class ConvergenceMonitor:
    """Follows a few coordinates of every site of a chain and judges its convergence.

    :param dict params: the chain's unconstrained parameters, site name -> tensor.
    """

    def __init__(self, params: dict[str, torch.Tensor]):
        generator = torch.Generator().manual_seed(0)  # not the chain's random stream
        self._index = {}
        for name, value in params.items():
            size = value.numel()
            if size <= COORDINATES_PER_SITE:
                chosen = torch.arange(size)
            else:  # a few draws with replacement, without a permutation of a large site
                chosen = torch.randint(size, (2 * COORDINATES_PER_SITE,), generator=generator)
                chosen = chosen.unique()[:COORDINATES_PER_SITE]
            self._index[name] = chosen.to(value.device)
        self._rows: list[list[float]] = []

    @property
    def width(self) -> int:
        """The number of followed coordinates."""
        return sum(len(index) for index in self._index.values())

    def coordinates(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """The followed coordinates of ``params`` as one vector, on their device."""
        return torch.cat(
            [params[name].detach().reshape(-1)[index] for name, index in self._index.items()]
        )

    def add(self, values: list[float]) -> None:
        """Record one kept draw's followed coordinates (as read from the device)."""
        self._rows.append(values)

    def warning(self) -> str | None:
        """A sentence naming the sites whose draws have split R-hat over ``MAX_RHAT`` or
        bulk ESS under ``MIN_ESS``, or None (also with fewer than four draws)."""
        if len(self._rows) < _MIN_DRAWS:
            return None
        draws = np.asarray(self._rows, dtype=float)[np.newaxis]
        r_hat, ess = rhat(draws, num_threads=1), ess_bulk(draws, num_threads=1)
        bad, worst_rhat, worst_ess, start = [], 1.0, np.inf, 0
        for name, index in self._index.items():
            site_rhat = np.nanmax(r_hat[start : start + len(index)], initial=1.0)
            site_ess = np.nanmin(ess[start : start + len(index)], initial=np.inf)
            start += len(index)
            if site_rhat > MAX_RHAT or site_ess < MIN_ESS:
                bad.append(name)
                worst_rhat, worst_ess = max(worst_rhat, site_rhat), min(worst_ess, site_ess)
        if not bad:
            return None
        shown = ", ".join(repr(name) for name in bad[:10])
        more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
        found = []
        if worst_rhat > MAX_RHAT:
            found.append(f"split R-hat up to {worst_rhat:.3g} (above {MAX_RHAT})")
        if worst_ess < MIN_ESS:
            found.append(f"bulk ESS down to {worst_ess:.3g} (below {MIN_ESS})")
        return (
            f"the {len(self._rows)} kept draws have {' and '.join(found)} on the sites "
            f"{shown}{more} (on up to {COORDINATES_PER_SITE} coordinates each): the chain "
            "has not yet explored the posterior"
        )
