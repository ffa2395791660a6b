"""What an SGMCMC chain samples: the model's latent sites in unconstrained space, its
minibatch log joint and that log joint's gradient; and where a chain starts.

Pyro's MCMC keeps unconstrained values and applies ``transforms[name].inv``; the
kernels do the same, so each constrained site is reached through ``biject_to`` of its
support, with the log-Jacobian of that map added to the log joint.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping

import pyro
import torch
from pyro.distributions.transforms import biject_to
from pyro.infer.autoguide.initialization import InitMessenger
from pyro.poutine.util import site_is_subsample

from pyro_bdl import distributed
from pyro_bdl._checks import instance, is_real, site_keys
from pyro_bdl.inference.log_joint import LogJoint, observed_num_data
from pyro_bdl.lift import init_to_module
from pyro_bdl.likelihoods import invalid_observations
from pyro_bdl.model_checks import check_model

__all__ = [
    "Target",
    "checked_init_params",
    "has_observations",
    "model_target",
    "placed_like",
    "prototype_trace",
]


class Target:
    """The model as a chain sees it.

    :param callable model: the Pyro model.
    :param dict sites: its latent sample sites, name -> trace node, in the model's order.
    :param dict bijections: name -> the map from the real line (or space) to the site's
        support, for each site whose support is not the reals.
    """

    def __init__(self, model: Callable, sites: dict[str, dict], bijections: dict):
        self.model, self.sites, self.bijections = model, sites, bijections

    @property
    def transforms(self) -> dict:
        """Pyro's ``transforms``: name -> the map from a site's support to the reals."""
        return {name: b.inv for name, b in self.bijections.items()}

    def unconstrain(self, name: str, value: torch.Tensor) -> torch.Tensor:
        bijection = self.bijections.get(name)
        return value if bijection is None else bijection.inv(value)

    def constrain(self, name: str, z: torch.Tensor) -> torch.Tensor:
        bijection = self.bijections.get(name)
        return z if bijection is None else bijection(z)

    def log_joint_and_grad(
        self, params: dict[str, torch.Tensor], args: tuple, kwargs: dict, average: bool = False
    ):
        """The minibatch log joint at ``params`` (unconstrained leaves) and its gradient;
        with ``average``, each averaged across the ranks of a data-parallel chain (the
        global batch's; the analytic priors' value, the same on every rank, is not)."""
        values = dict(params)
        log_jacobian = 0.0
        for name, bijection in self.bijections.items():
            z = params[name]
            values[name] = x = bijection(z)
            log_jacobian = log_jacobian + bijection.log_abs_det_jacobian(z, x).sum()
        with LogJoint(values, analytic_priors=True) as log_joint:
            self.model(*args, **kwargs)
        if self.bijections:
            log_joint.autograd_value = log_joint.autograd_value + log_jacobian
        total, leaves = log_joint.autograd_value, list(params.values())
        if torch.is_tensor(total) and total.requires_grad:
            grads = torch.autograd.grad(total, leaves, allow_unused=True)
        else:
            grads = [None] * len(leaves)
        grads = {
            name: torch.zeros_like(z) if g is None else g
            for (name, z), g in zip(params.items(), grads)
        }
        log_joint.add_prior_scores(grads)
        grads = list(grads.values())
        if torch.is_tensor(total):
            log_joint.autograd_value = total = total.detach()
            if average:
                distributed.all_reduce_([total, *grads], op="mean")  # the global batch's
        return log_joint, grads


def model_target(
    model: Callable,
    batch: tuple[tuple, dict],
    init_params: object,
    *,
    num_data: int | None,
    full_batch: bool,
    kernel: str,
) -> tuple[Target, int]:
    """The :class:`Target` of ``model`` on its first ``batch`` ``(args, kwargs)``, its
    latent sites checked, and the data-set size N.

    :param init_params: the chain's start rule (see :func:`prototype_trace`).
    :param num_data: N if the user gave it, else read from the model's likelihood.
    :param bool full_batch: whether the batch is the whole data set (no DataLoader).
    :param str kernel: the kernel's name, for the messages.
    """
    trace = prototype_trace(model, init_params, *batch)
    check_model(trace, *batch, caller=kernel)
    sites = {
        name: site
        for name, site in trace.nodes.items()
        if site["type"] == "sample" and not site["is_observed"] and not site_is_subsample(site)
    }
    if not sites:
        raise ValueError("the model has no latent sample sites for the kernel to sample")
    if isinstance(init_params, Mapping):
        site_keys("init_params", init_params, sites, "the model's latent sites")
    for name, site in sites.items():
        if site["fn"].support.is_discrete:
            raise ValueError(
                f"site {name!r} is discrete; SGMCMC kernels need continuous latent sites"
            )
    num_data = observed_num_data(trace, num_data, full_batch=full_batch)
    if not has_observations(trace):
        warnings.warn(
            f"{kernel}: the model has no observed site, so the kernel samples "
            f"the prior of {sorted(sites)}; condition on data with "
            "pyro.sample(..., obs=...) or bdl.observe(...) to sample a posterior",
            UserWarning,
            stacklevel=4,
        )
        num_data = num_data or 1
    if num_data is None:
        raise ValueError(
            "num_data: the model's likelihood declares no data-set size (no "
            "bdl.observe(..., num_data=N)); pass num_data=<size of the training set> "
            "to the kernel"
        )
    bijections = {
        name: biject_to(site["fn"].support)
        for name, site in sites.items()
        if not is_real(site["fn"].support)
    }
    return Target(model, sites, bijections), num_data


def prototype_trace(
    model: Callable, init_params: object, args: tuple, kwargs: dict
) -> pyro.poutine.Trace:
    """A trace of ``model`` at the chain's start, by the rule ``init_params`` gives."""
    if init_params is None:
        strategy = init_to_module
    elif callable(init_params):
        strategy = init_params
    else:
        strategy = _init_from_dict(init_params)
    model = InitMessenger(strategy)(model)
    with torch.no_grad(), pyro.poutine.block():
        trace = pyro.poutine.trace(model).get_trace(*args, **kwargs)
        if invalid_observations(trace):
            # Inside pyro.infer.MCMC validation is off and observe only marked them;
            # with it on, observe names them.
            with pyro.validation_enabled(True):
                pyro.poutine.trace(model).get_trace(*args, **kwargs)
    return trace


def has_observations(trace: pyro.poutine.Trace) -> bool:
    """Whether a trace has an observed sample site (``pyro.deterministic`` is none)."""
    return any(
        site["type"] == "sample"
        and site["is_observed"]
        and not site_is_subsample(site)
        and not site["infer"].get("_deterministic")
        for site in trace.nodes.values()
    )


def checked_init_params(init_params: object) -> object:
    """``init_params`` if it is None, a Pyro init strategy or a dict of finite real
    site values; else a named error."""
    if init_params is None or callable(init_params):
        return init_params
    if not isinstance(init_params, Mapping):
        raise TypeError(
            "init_params must be None, a dict of site values or a Pyro init strategy, "
            f"got {type(init_params).__name__}"
        )
    for name, value in init_params.items():
        instance("init_params key", name, str, "a site name (str)")
        try:
            tensor = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"init_params[{name!r}] must be a tensor (or array) of site values, got "
                f"{type(value).__name__}"
            ) from None
        if not tensor.is_floating_point():
            raise TypeError(
                f"init_params[{name!r}] must hold real numbers, got dtype {tensor.dtype}"
            )
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"init_params[{name!r}] has non-finite values")
    return init_params


def placed_like(
    values: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor], what: str
) -> dict[str, torch.Tensor]:
    """``values`` checked against ``like`` (same sites and shapes, finite) and moved to
    its dtype and device (a CUDA model started from CPU tensors)."""
    site_keys(what, values, like, "the model's latent sites")
    placed = {}
    for name, reference in like.items():
        if name not in values:
            raise ValueError(f"{what}: no value for the site {name!r}; it has {sorted(values)}")
        value = torch.as_tensor(values[name])
        if value.shape != reference.shape:
            raise ValueError(
                f"{what}[{name!r}] has shape {tuple(value.shape)}, but the site has shape "
                f"{tuple(reference.shape)}"
            )
        value = value.detach().to(dtype=reference.dtype, device=reference.device)
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"{what}[{name!r}] has non-finite values")
        placed[name] = value
    return placed


def _init_from_dict(values: Mapping[str, torch.Tensor]) -> Callable[[dict], torch.Tensor]:
    def init(site: dict) -> torch.Tensor:
        # the default start gives the site's shape, dtype and device; its fallback,
        # init_to_feasible, draws from the prior to find them, which must not move the
        # random stream of a chain whose start is given
        with torch.random.fork_rng(devices=[]):
            reference = init_to_module(site)
        if site["name"] not in values:
            return reference
        value = torch.as_tensor(values[site["name"]])
        if value.shape != reference.shape:
            raise ValueError(
                f"init_params[{site['name']!r}] has shape {tuple(value.shape)}, but the site "
                f"has shape {tuple(reference.shape)}"
            )
        return value.detach().to(dtype=reference.dtype, device=reference.device, copy=True)

    return init
