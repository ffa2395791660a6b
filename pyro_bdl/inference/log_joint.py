"""The minibatch log joint of a Pyro model at given latent values, with its gradient.

Every gradient-based method here (SGMCMC steps, MAP fits) needs
``log p(theta) + (N/B) sum_batch log p(y_i | theta)`` at given values of the latent
sites. :class:`LogJoint` computes it in one pass of the model: it conditions the
latent sites and accumulates each site's scaled and masked log density as the model
runs. We do not build a ``poutine.trace`` for this because copying every site's
message into a trace costs more than the update itself on small networks.

With ``analytic_priors=True`` the isotropic normal priors of :mod:`pyro_bdl.priors`
are not evaluated while the model runs: their gradient ``-(theta - loc) / scale**2``
is left to the caller (:meth:`LogJoint.add_prior_scores`), which adds it in place, and
their value to :meth:`LogJoint.analytic_prior_value`, one fused pass over all of them,
computed only when asked (a sampler asks when it keeps a draw). Through autograd the
same gradient costs two more passes over the weights and two weight-sized allocations
per step, and evaluating each prior as the model runs costs a Python call and a kernel
launch per weight tensor, together more than a tenth of an SGD step on networks of
many small tensors (LoRA adapters).

:func:`observed_num_data` reads, from a trace of the model, the data-set size ``N``
that the likelihood is scaled to, and refuses a likelihood that is not scaled at all
(a model that subsamples with its own ``pyro.plate``); every fit that needs ``N``
calls it on its prototype trace.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import pyro
import torch
from pyro.distributions.util import scale_and_mask
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample

from pyro_bdl._checks import instance, integer
from pyro_bdl.likelihoods import NUM_DATA_KEY
from pyro_bdl.priors import IsotropicNormal

__all__ = ["LogJoint", "observed_num_data"]


class LogJoint(Messenger):
    """Condition latent sites on ``values`` and sum the log densities of all sites.

    Example::

        with LogJoint(values) as log_joint:
            model(batch, num_data)
        log_joint.value.backward()

    :param dict values: latent site name -> value (in the site's support).
    :param bool analytic_priors: leave the gradient and the value of isotropic normal
        priors to :meth:`add_prior_scores` and :meth:`analytic_prior_value` (see the
        module docstring); :attr:`autograd_value` is then the rest of the log joint.
    :param likelihood_only: True: sum the observed sites only, leaving out the priors of
        the latent sites (for methods that treat the prior in closed form, as IVON does);
        a collection of latent site names: leave out the priors of those sites only.
    :ivar bool observed: whether an observed site (not a ``pyro.deterministic``) was seen.
    """

    def __init__(
        self,
        values: dict[str, torch.Tensor],
        analytic_priors: bool = False,
        *,
        likelihood_only: bool | Collection[str] = False,
    ):
        super().__init__()
        self.values = instance("values", values, Mapping, "a dict site name -> value")
        self.analytic_priors = instance("analytic_priors", analytic_priors, bool, "True or False")
        self.likelihood_only = instance(
            "likelihood_only", likelihood_only, (bool, Collection), "True, False or site names"
        )
        self.observed = False
        #: The log joint less the analytic priors: what autograd differentiates.
        self.autograd_value: torch.Tensor | float = 0.0
        # site -> (loc, precision * scale): the prior's score is -coef * (theta - loc).
        self.prior_scores: dict[str, tuple[float, float]] = {}
        # site -> (prior, site scale), for the value of the analytic priors.
        self._analytic: dict[str, tuple[IsotropicNormal, float]] = {}
        self._latent: set[str] = set()

    @property
    def value(self) -> torch.Tensor | float:
        """The whole log joint (the analytic priors' value computed on access)."""
        if not self._analytic:
            return self.autograd_value
        return self.autograd_value + self.analytic_prior_value()

    def _pyro_sample(self, msg: dict) -> None:
        if msg["is_observed"] or site_is_subsample(msg):
            return
        try:
            msg["value"] = self.values[msg["name"]]
        except KeyError:
            raise KeyError(
                f"the model has a latent site {msg['name']!r} that was not there when "
                "inference started; the set of latent sites must not change between calls"
            ) from None
        msg["is_observed"] = True
        self._latent.add(msg["name"])

    def _leaves_out(self, name: str) -> bool:
        if name not in self._latent or self.likelihood_only is False:
            return False
        return self.likelihood_only is True or name in self.likelihood_only

    def _pyro_post_sample(self, msg: dict) -> None:
        if site_is_subsample(msg) or self._leaves_out(msg["name"]):
            return
        if msg["name"] not in self._latent and not msg["infer"].get("_deterministic"):
            self.observed = True
        fn, scale = msg["fn"], msg["scale"]
        if (
            self.analytic_priors
            and type(fn) is IsotropicNormal
            and msg["name"] in self._latent
            and type(scale) in (int, float)
            and msg["mask"] is None
        ):
            self.prior_scores[msg["name"]] = (fn.loc_value, scale / fn.scale_value**2)
            self._analytic[msg["name"]] = (fn, scale)
            return
        log_prob = scale_and_mask(
            fn.log_prob(msg["value"], *msg["args"], **msg["kwargs"]), scale, msg["mask"]
        )
        self._add(msg, log_prob.sum())

    def _add(self, msg: dict, log_prob: torch.Tensor) -> None:
        """Add one site's (scaled, masked) log density; a subclass may split the sum."""
        self.autograd_value = self.autograd_value + log_prob

    @torch.no_grad()
    def add_prior_scores(self, grads: dict[str, torch.Tensor]) -> None:
        """Add the analytic prior gradients in place to ``grads`` (site -> gradient)."""
        by_coefficient: dict[float, list[str]] = {}
        for name, (loc, coefficient) in self.prior_scores.items():
            by_coefficient.setdefault(coefficient, []).append(name)
            if loc:
                grads[name].add_(loc * coefficient)
        for coefficient, names in by_coefficient.items():
            torch._foreach_add_(
                [grads[n] for n in names], [self.values[n] for n in names], alpha=-coefficient
            )

    def analytic_prior_value(self) -> torch.Tensor | float:
        """The summed (scaled) log densities of the analytic priors, without a graph.

        One fused norm per group of equal ``(loc, scale)``:
        :math:`-\\lVert\\theta - loc\\rVert^2 / (2 scale^2) - d (\\log scale + \\log(2\\pi)/2)`.
        """
        groups: dict[tuple[float, float, float], list[torch.Tensor]] = {}
        constant = 0.0
        for name, (fn, scale) in self._analytic.items():
            groups.setdefault((fn.loc_value, fn.scale_value, scale), []).append(
                self.values[name].detach()
            )
            constant -= scale * fn._log_normaliser
        total: torch.Tensor | float = constant
        with torch.no_grad():
            for (loc, prior_scale, scale), tensors in groups.items():
                if loc:
                    tensors = torch._foreach_sub(tensors, loc)
                square = torch.stack(torch._foreach_norm(tensors)).square().sum()
                total = total - 0.5 * scale / prior_scale**2 * square
        return total


def observed_num_data(
    trace: pyro.poutine.Trace, num_data: int | None = None, *, full_batch: bool = True
) -> int | None:
    """The data-set size N that the observed sites of a trace are scaled to, checked.

    A site made by ``bdl.observe(..., num_data=N)``, or inside a ``pyro.plate`` of full
    size N subsampled to the batch, counts its log likelihood ``N / B`` times. A site
    with a batch of examples, no such plate and no scale of its own counts the batch
    once: a model that wraps a minibatch in its own ``pyro.plate("data", len(x))``
    treats the batch as the whole data set and its posterior is too wide by ``N / B``,
    silently. This function refuses that (when N is known and larger than the batch),
    sites declaring different sizes, and a declared size other than the ``num_data``
    the caller was given. A site without a batch dimension (one global observation)
    and a site the user scaled with ``poutine.scale`` are taken as meant.

    Example::

        trace = pyro.poutine.trace(model).get_trace(batch, len(train_set))
        num_data = observed_num_data(trace)           # the N of bdl.observe

    :param trace: a trace of the model on one minibatch.
    :param int num_data: the data-set size the caller was given, if any.
    :param bool full_batch: whether the traced batch may be the whole data set: then,
        when nothing else tells N, it is the batch size of the unscaled sites. Pass False
        when it is a minibatch (the model's arguments hold a DataLoader), so that an
        unscaled site is refused even without ``num_data``.
    :return: N (``num_data`` if given), or None if nothing tells it.
    :raises ValueError: if the observed sites are not scaled consistently with N.
    """
    instance("trace", trace, pyro.poutine.Trace, "a Pyro trace of the model")
    if num_data is not None:
        num_data = integer("num_data", num_data, low=1)
    instance("full_batch", full_batch, bool, "True or False")
    declared, unscaled = {}, {}
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or not site["is_observed"] or site_is_subsample(site):
            continue
        batch_shape = site["fn"].batch_shape
        if NUM_DATA_KEY in site["infer"]:  # bdl.observe, with or without num_data
            size = site["infer"][NUM_DATA_KEY]
            unscaled_batch = size is None
        else:
            size = next(
                (f.full_size for f in site["cond_indep_stack"] if f.full_size != f.size), None
            )
            scale = site["scale"]
            unscaled_batch = size is None and not torch.is_tensor(scale) and scale == 1
        if size is not None:
            declared[name] = size
        elif unscaled_batch and batch_shape and batch_shape[0] > 1:
            unscaled[name] = batch_shape[0]
    sizes = set(declared.values())
    if len(sizes) > 1:
        raise ValueError(
            f"num_data: the observed sites are scaled to different data-set sizes {declared}; "
            "scale every likelihood to the size of the training set"
        )
    model_size = sizes.pop() if sizes else None
    if num_data is not None and model_size is not None and model_size != num_data:
        site = next(iter(declared))
        raise ValueError(
            f"num_data={num_data}, but the observed site {site!r} is scaled to a data set "
            f"of {model_size} (its bdl.observe num_data or plate size); pass the same size "
            "to both, or leave num_data out to use the model's"
        )
    expected = num_data if num_data is not None else model_size
    if expected is None and full_batch and unscaled:
        expected = max(unscaled.values())
    for name, batch_size in unscaled.items():
        if expected is not None and batch_size != expected:
            raise ValueError(
                f"the observed site {name!r} has a batch of {batch_size} examples and no "
                f"num_data scale, so its log likelihood counts the batch as the whole data "
                f"set, but the data set has {expected} examples (num_data). A model that "
                "subsamples with its own pyro.plate('data', len(x)) is scaled as if the "
                f"batch were all the data; observe it with bdl.observe({name!r}, "
                "distribution, obs, num_data=N) (or pyro.plate('data', N, subsample=...)) "
                "so that it counts N / B times"
            )
    return expected
