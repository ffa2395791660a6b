"""A finished chain's split R-hat and bulk ESS, in weight space and, for a network, in
function space.

**Weight space.** Each kept draw records up to ``COORDINATES_PER_SITE`` coordinates of
every site (all of a smaller site; otherwise a fixed random choice, the same for every
draw and every chain), read from the device together with the draw's statistics, so the
check costs nothing per step and a few numbers per draw, however large the model. When
the chain ends, the rank-normalised split R-hat (the chain cut in halves, as ArviZ and
Pyro cut each chain) and the bulk ESS of :mod:`pyro_bdl.diagnostics` are computed on
them; both are invariant under the monotone maps between a constrained site and its
unconstrained coordinates.

**Function space.** For a network made by :func:`~pyro_bdl.lift`, R-hat of its weights is
the wrong question: permuting hidden units or flipping a tanh unit's signs gives other
weights and the same function, so chains in symmetric modes have weight-space R-hat far
above 1 and the same predictions (Izmailov et al. 2021). The kernel also follows the
network's outputs (the likelihood's class probabilities, or its mean) on a fixed probe
batch, the kernel's ``probe`` or the first minibatch of the run's first chain, one forward
pass per kept draw, over every chain of the run (the chains of
:class:`~pyro_bdl.inference.Chains` share the probe). The warning then speaks about
function space first, with :func:`pyro_bdl.diagnostics.function_space`'s R-hat, ESS,
agreement and total variation over the chains so far, and says when weight-space R-hat
is high only because the chains sit in symmetric modes
(:class:`~pyro_bdl.inference.sgmcmc.convergence.SymmetricModesWarning`).
"""

from __future__ import annotations

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.poutine.util import site_is_subsample

from pyro_bdl.diagnostics import (
    FUNCTION_MAX_RHAT,
    FunctionSpace,
    ess_bulk,
    function_space,
    rhat,
)
from pyro_bdl.lift import is_lifted_site

__all__ = [
    "ConvergenceMonitor",
    "FunctionSpaceMonitor",
    "SymmetricModesWarning",
    "convergence_warning",
    "MAX_RHAT",
    "MIN_ESS",
    "COORDINATES_PER_SITE",
    "MAX_OUTPUTS",
]

#: Split R-hat above this is a warning (Vehtari et al. 2021).
MAX_RHAT = 1.01
#: Bulk ESS below this is a warning: posterior means then carry a Monte Carlo error over
#: a tenth of a posterior standard deviation.
MIN_ESS = 100
#: Coordinates of each site that are followed.
COORDINATES_PER_SITE = 8
#: Outputs of the probe batch that are followed (a fixed random choice beyond it, e.g.
#: for a language model's vocabulary).
MAX_OUTPUTS = 1024
#: Fewest kept draws the diagnostics are defined for.
_MIN_DRAWS = 4


class SymmetricModesWarning(UserWarning):
    """A network's predictions have converged while its weight-space R-hat is high: the
    chains sit in modes related by the network's symmetries. Nothing needs fixing."""


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

    @property
    def rows(self) -> np.ndarray:
        """The followed coordinates of every kept draw, ``(draw, coordinate)``."""
        return np.asarray(self._rows, dtype=float).reshape(len(self._rows), self.width)

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
        finding = self.finding(self.rows[np.newaxis])
        if finding is None:
            return None
        return (
            f"the {len(self._rows)} kept draws have {finding}: the chain has not yet explored "
            "the posterior"
        )

    def finding(self, draws: np.ndarray) -> str | None:
        """What is wrong with the followed coordinates ``draws`` ``(chain, draw,
        coordinate)`` (of one chain or several): the sites with split R-hat over
        ``MAX_RHAT`` or bulk ESS under ``MIN_ESS``, or None."""
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
            f"{' and '.join(found)} on the sites {shown}{more} (on up to "
            f"{COORDINATES_PER_SITE} coordinates each)"
        )


class FunctionSpaceMonitor:
    """A network's outputs on a fixed probe batch at every kept draw of every chain of a
    run, and the weight coordinates each finished chain followed.

    Made by :meth:`for_chain`, which returns None for a model that is not a lifted
    network or whose likelihood has no outputs to read.

    :param target: the chain's :class:`~pyro_bdl.inference.sgmcmc.target.Target`.
    :param tuple probe: the model's ``(args, kwargs)`` on the probe batch.
    """

    def __init__(self, target, probe: tuple[tuple, dict]):
        self.model, self.probe = target.model, probe
        self._constrain = target.constrain
        self._latent = set(target.sites)
        start = {name: site["value"] for name, site in target.sites.items()}
        outputs, self.probabilities = self._likelihood_outputs(start)
        self.shape = () if outputs is None else tuple(outputs.shape)
        self._index = None
        if outputs is not None and outputs.numel() > MAX_OUTPUTS:
            generator = torch.Generator().manual_seed(0)
            chosen = torch.randperm(outputs.numel(), generator=generator)[:MAX_OUTPUTS]
            self._index = chosen.sort().values.to(outputs.device)
            self.probabilities = False  # a choice of classes is not a distribution
        self._outputs: list[list[list[float]]] = []  # chain -> draw -> outputs
        self._weights: list[np.ndarray] = []  # finished chain -> its followed weights
        self._weight_monitor: ConvergenceMonitor | None = None

    @classmethod
    def for_chain(
        cls, previous: FunctionSpaceMonitor | None, chain: int | None, target, probe
    ) -> FunctionSpaceMonitor | None:
        """The monitor of a chain that starts: ``previous``'s, continued, for a later
        chain of the same run (``chain`` > 0, the same model), else a new one on
        ``probe`` (``(args, kwargs)``), or None for a model that is not a lifted network.
        """
        continued = previous is not None and chain not in (None, 0)
        if continued and previous.model is target.model:
            monitor = previous
        elif any(is_lifted_site(site) for site in target.sites.values()):
            monitor = cls(target, probe)
            if not monitor.shape:
                return None
        else:
            return None
        monitor._outputs.append([])
        return monitor

    def add(self, params: dict[str, torch.Tensor]) -> None:
        """Record the outputs at one kept draw's (unconstrained) ``params``."""
        values = {name: self._constrain(name, z) for name, z in params.items()}
        outputs, _ = self._likelihood_outputs(values)
        outputs = outputs.reshape(-1)
        if self._index is not None:
            outputs = outputs[self._index]
        self._outputs[-1].append(outputs.tolist())

    def outputs(self) -> np.ndarray | None:
        """The followed outputs of every chain, ``(chain, draw, probe, *output)`` (or
        ``(chain, draw, output)`` for a choice of them), when every chain kept as many
        draws; else None."""
        lengths = {len(chain) for chain in self._outputs}
        if len(lengths) != 1 or 0 in lengths:
            return None
        outputs = np.asarray(self._outputs, dtype=float)
        if self._index is not None:
            return outputs
        return outputs.reshape(*outputs.shape[:2], *self.shape)

    def finish_chain(self, weights: ConvergenceMonitor) -> None:
        """Keep the weight coordinates the finished chain followed."""
        self._weights.append(weights.rows)
        self._weight_monitor = weights

    def diagnostics(self) -> tuple[FunctionSpace, int, int] | None:
        """The function-space diagnostics of the chains so far (each cut to the shortest
        one's draws), with the number of chains and draws; None under four draws."""
        draws = min(len(chain) for chain in self._outputs)
        if draws < _MIN_DRAWS:
            return None
        outputs = np.asarray([chain[:draws] for chain in self._outputs], dtype=float)
        if self._index is None:
            outputs = outputs.reshape(len(self._outputs), draws, *self.shape)
        return function_space(outputs, probabilities=self.probabilities), len(outputs), draws

    def weight_finding(self) -> str | None:
        """The weight-space finding over the finished chains (as :meth:`ConvergenceMonitor.
        finding`)."""
        draws = min(len(rows) for rows in self._weights)
        if draws < _MIN_DRAWS or self._weight_monitor is None:
            return None
        return self._weight_monitor.finding(np.stack([rows[:draws] for rows in self._weights]))

    def _likelihood_outputs(self, values: dict) -> tuple[torch.Tensor | None, bool]:
        """The first likelihood site's class probabilities (or mean) at the latent
        ``values``, and whether they are probabilities; (None, False) if it has none."""
        args, kwargs = self.probe
        device = next(iter(values.values())).device
        # The forward pass must not move the chain's random stream (dropout, obs=None).
        devices = [device] if device.type == "cuda" else []
        with (
            torch.no_grad(),
            torch.random.fork_rng(devices=devices),
            pyro.poutine.block(),
        ):
            conditioned = pyro.poutine.condition(self.model, values)
            trace = pyro.poutine.trace(conditioned).get_trace(*args, **kwargs)
        for name, site in trace.nodes.items():
            likelihood = (
                site["type"] == "sample"
                and name not in self._latent
                and not site_is_subsample(site)
                and not site["infer"].get("_deterministic")
            )
            if likelihood:
                return _outputs_of(site["fn"])
        return None, False


def _outputs_of(fn) -> tuple[torch.Tensor | None, bool]:
    """A likelihood's class probabilities, or its mean; and whether they are
    probabilities. (None, False) for a distribution with neither."""
    while isinstance(fn, (dist.Independent, dist.MaskedDistribution)):
        fn = fn.base_dist
    if isinstance(fn, (dist.Categorical, dist.OneHotCategorical)):
        return fn.probs.detach(), True
    try:
        mean = fn.mean.detach()
    except NotImplementedError:
        return None, False
    return (mean, False) if bool(torch.isfinite(mean).all()) else (None, False)


def convergence_warning(
    weights: ConvergenceMonitor, outputs: FunctionSpaceMonitor | None
) -> tuple[str, type[Warning]] | None:
    """The end-of-chain warning and its category, or None when nothing is to be said.

    Without ``outputs`` (not a network), the weight-space sentence of
    :meth:`ConvergenceMonitor.warning`. For a network, function space first: a
    ``RuntimeWarning`` when its outputs have not converged over the chains so far, a
    :class:`SymmetricModesWarning` when they have and the weights have not.
    """
    if outputs is not None:
        outputs.finish_chain(weights)
        found = outputs.diagnostics()
        if found is not None:
            return _network_warning(*found, outputs.weight_finding(), outputs.shape)
    message = weights.warning()
    return None if message is None else (message, RuntimeWarning)


def _network_warning(
    fs: FunctionSpace, num_chains: int, num_draws: int, weights: str | None, shape: tuple
) -> tuple[str, type[Warning]] | None:
    converged = fs.converged(FUNCTION_MAX_RHAT, MIN_ESS)
    if converged and weights is None:
        return None
    chains = "1 chain" if num_chains == 1 else f"{num_chains} chains"
    where = (
        f"the network's outputs on the {shape[0]} probe inputs, over {chains} of "
        f"{num_draws} kept draws"
    )
    agree = ""
    if not np.isnan(fs.agreement):
        agree = (
            f"; the chains' predictives agree on the top class for {fs.agreement:.0%} of the "
            f"inputs, total variation {fs.total_variation:.3g}"
        )
    if not converged:
        found = []
        chance = fs.independent_max_rhat
        if fs.max_rhat > FUNCTION_MAX_RHAT and fs.max_rhat <= chance:  # no finding
            found.append(
                f"split R-hat up to {fs.max_rhat:.3g}, which independent draws as many also "
                f"reach over as many outputs ({chance:.3g}: too few draws for R-hat to judge)"
            )
        elif fs.max_rhat > FUNCTION_MAX_RHAT:
            above = f"above {FUNCTION_MAX_RHAT}"
            if not fs.judgeable:
                above += f" and the {chance:.3g} that independent draws as many reach"
            found.append(f"split R-hat up to {fs.max_rhat:.3g} ({above})")
        if fs.min_ess < MIN_ESS:
            found.append(f"bulk ESS down to {fs.min_ess:.3g} (below {MIN_ESS})")
        in_weights = (
            f"in weight space, {weights}" if weights else "the followed weights look converged"
        )
        return (
            f"in function space, {where}, have {' and '.join(found)}{agree}: the predictive "
            f"distribution has not converged; {in_weights}",
            RuntimeWarning,
        )
    why = (
        "the chains sit in different modes that make the same predictions"
        if num_chains > 1
        else "the chain moves between weights that make the same predictions"
    )
    return (
        f"in function space the predictive has converged: {where}, have split R-hat at most "
        f"{fs.max_rhat:.3g} and bulk ESS at least {fs.min_ess:.3g}{agree}. In weight space "
        f"the draws have {weights}, high only because {why} (permuting a layer's hidden "
        "units, or flipping the signs of a unit's weights in and out, leaves a network's "
        "function unchanged): judge this run by function space (bdl.diagnostics."
        "function_space; bdl.to_arviz adds the outputs as its 'function_space' group)",
        SymmetricModesWarning,
    )
