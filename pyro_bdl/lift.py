"""Lift chosen weights of a torch module into Pyro sample sites.

:func:`lift` wraps any :class:`torch.nn.Module`, a peft ``PeftModel`` over a Hugging
Face model included, without changing it. Calling the wrapper inside a Pyro model
samples each *random* weight at a ``pyro.sample`` site with its prior, reads each
*point* weight with ``pyro.param``, and runs the module's forward through
:func:`torch.func.functional_call` with those tensors. Every other parameter is the
module's own: parameters with ``requires_grad=False`` (a frozen pretrained base) are
never registered, never given a gradient and never copied.

We do not use ``pyro.nn.module.to_pyro_module_``: it fails on Hugging Face classes
with a metaclass conflict and would register the frozen base as trainable.

Activation checkpointing recomputes layers during the backward pass, after
``functional_call`` has put the module's own weights back: turn it on with
:func:`pyro_bdl.models.enable_checkpointing`, never with the model's own
``gradient_checkpointing_enable``, or the gradients belong to the wrong weights.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from pyro.infer.autoguide.initialization import init_to_feasible, init_to_sample
from pyro.poutine.runtime import get_plates
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_unflatten

from pyro_bdl._checks import instance, site_keys
from pyro_bdl.priors import IIDNormal, Prior

__all__ = [
    "lift",
    "LiftedModule",
    "init_to_module",
    "is_lifted_site",
    "parameter_owner",
    "recording_calls",
    "Selector",
]

Selector = None | str | Sequence[str] | Callable[[str, torch.Tensor], bool]

# The key under which a lifted site carries its module weight, so that kernels and
# guides can start from the pretrained value (see init_to_module).
_INIT_KEY = "bdl_module_weight"


def init_to_module(site: dict, fallback: Callable[[dict], torch.Tensor] = init_to_feasible):
    """Pyro init strategy: a lifted weight starts at the module's current value.

    A lifted weight never starts at a random draw, which would destroy a pretrained
    network. Sites that :func:`lift` did not create fall back to ``fallback``: by
    default Pyro's :func:`~pyro.infer.autoguide.initialization.init_to_feasible`, the
    point ``biject_to(support)(0)``, the default of Pyro's ``AutoNormal``: a feasible
    point of every support (a ``HalfCauchy`` scale, whose mean is infinite, starts at 1),
    the same at every call, whatever the prior's parameters. A discrete site (a label the
    model samples when it predicts, ``obs=None``) is drawn from its distribution: it has
    no unconstrained space, and no method here starts a chain or a guide there.

    :param dict site: a Pyro sample-site message.
    :param callable fallback: init strategy for sites that are not lifted weights.
    """
    weight = site["infer"].get(_INIT_KEY)
    if weight is not None:
        return weight.detach().clone()
    if site["fn"].support.is_discrete:
        return init_to_sample(site)
    return fallback(site)


def is_lifted_site(site: dict) -> bool:
    """Whether a Pyro sample site is a weight of a network made by :func:`lift`.

    :param dict site: a Pyro sample-site message or trace node.
    """
    return site["infer"].get(_INIT_KEY) is not None


def _selector_matches(
    selector: Selector,
    argument: str,
    trainable: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
) -> list[str]:
    """The names of trainable parameters that ``selector`` picks (at least one)."""
    if selector is None:
        return []
    if isinstance(selector, str):
        names = [name for name in trainable if selector in name]
    elif callable(selector):
        names = [name for name, param in trainable.items() if selector(name, param)]
    elif isinstance(selector, Sequence) and all(isinstance(n, str) for n in selector):
        tied = {name: aliases[name] for name in selector if name in aliases}
        if tied:
            raise ValueError(
                f"lift: {argument} names tied parameters by their second names {tied}; "
                "select each by its first name (the one module.named_parameters() gives)"
            )
        unknown = [name for name in selector if name not in trainable]
        if unknown:
            raise ValueError(
                f"lift: {argument} names parameters that are not trainable parameters of the "
                f"module: {unknown[:5]}; trainable ones include {list(trainable)[:5]}. Pass "
                "names from module.named_parameters() whose requires_grad is True."
            )
        names = list(dict.fromkeys(selector))
    else:
        raise TypeError(
            f"lift: {argument} must be a substring, a list of parameter names or a predicate "
            f"(name, param) -> bool, got {type(selector).__name__}"
        )
    if not names:
        raise ValueError(
            f"lift: {argument}={selector!r:.80} matches no trainable parameter; trainable "
            f"parameters include {list(trainable)[:5]} (frozen ones, requires_grad=False, "
            "cannot be selected)"
        )
    return names


class LiftedModule:
    """A torch module whose chosen weights are Pyro sites (made by :func:`lift`).

    :ivar torch.nn.Module module: the wrapped module, unchanged.
    :ivar dict random_sites: site name -> parameter name, for the random weights.
    :ivar dict point_sites: site name -> parameter name, for the point weights.
    :ivar str made_by: the call that made it, ``"lift"`` or ``"lora_model"``: errors about
        which weights are random advise in that call's arguments.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        prior: Prior,
        random_names: Sequence[str],
        point_names: Sequence[str],
        prefix: str,
        frozen_names: Sequence[str] = (),
    ):
        self.module = module
        self.prefix = prefix
        self._params = dict(module.named_parameters())
        self._frozen = list(frozen_names)
        self._aliases = _aliases(module, [*random_names, *point_names, *frozen_names])
        self.random_sites = {prefix + name: name for name in random_names}
        self.point_sites = {prefix + name: name for name in point_names}
        self._prior_cache: dict[str, tuple[Any, dist.TorchDistribution]] = {}
        self._fixed_depth = 0
        self.made_by = "lift"
        self.prior = prior

    @property
    def prior(self) -> Prior:
        """The prior of the random weights; assigning a new one takes effect at once."""
        return self._prior

    @prior.setter
    def prior(self, prior: Prior) -> None:
        if isinstance(prior, type) or not hasattr(prior, "distribution"):
            raise TypeError(
                "lift: prior must be a prior object with distribution(name, param), e.g. "
                f"bdl.priors.IIDNormal(0.2) (see pyro_bdl.priors), got {_describe(prior)}"
            )
        # A prior keyed by parameter name (LayerwiseNormal's mapping, a Laplace posterior)
        # must name lifted weights: a key that names none would be silently unused.
        check_names = getattr(prior, "check_names", None)
        if check_names is not None:
            check_names(list(self.random_sites.values()))
        self._prior = prior
        self._prior_cache.clear()

    def parameter(self, site: str) -> torch.nn.Parameter:
        """The module parameter behind a random or point site."""
        name = self.random_sites.get(site) or self.point_sites.get(site)
        if name is None:
            raise KeyError(f"{site!r} is not a site of this lifted module")
        return self._params[name]

    def owner(self, site: str) -> tuple[torch.nn.Module, str]:
        """The submodule that holds a site's parameter and the attribute name in it.

        Curvature code uses it to hook the layer (e.g. the ``nn.Linear`` of a LoRA A).
        """
        name = self.random_sites.get(site) or self.point_sites.get(site)
        if name is None:
            raise KeyError(f"{site!r} is not a site of this lifted module")
        return parameter_owner(self.module, name)

    def prior_distribution(self, site: str) -> dist.TorchDistribution:
        """The prior of one random site (cached per dtype and device)."""
        param = self._params[self.random_sites[site]]
        key = (param.dtype, param.device, param.shape)
        cached = self._prior_cache.get(site)
        if cached is not None and cached[0] == key:
            return cached[1]
        distribution = self._prior.distribution(self.random_sites[site], param)
        if distribution.event_shape != param.shape or distribution.batch_shape != ():
            raise ValueError(
                f"prior {self._prior!r} gave {site!r} a distribution with batch shape "
                f"{tuple(distribution.batch_shape)} and event shape "
                f"{tuple(distribution.event_shape)}; the parameter has shape "
                f"{tuple(param.shape)}: a prior must return batch shape () and event shape "
                "equal to the parameter's (use .to_event())"
            )
        self._prior_cache[site] = (key, distribution)
        return distribution

    def init_values(self) -> dict[str, torch.Tensor]:
        """Detached copies of the module's current values of the random weights."""
        return {
            site: self._params[name].detach().clone() for site, name in self.random_sites.items()
        }

    def __call__(self, *args, **kwargs):
        if self._fixed_depth:
            return self.module(*args, **kwargs)
        self._warn_inside_subsampled_plate()
        values = {}
        batched = []  # the random weights that carry a batch of draws
        for site, name in self.random_sites.items():
            param = self._params[name]
            value = pyro.sample(site, self.prior_distribution(site), infer={_INIT_KEY: param})
            values[name] = value
            if value.shape != param.shape:
                batched.append(name)  # draws stacked in front, or a wrong shape (an error)
        for site, name in self.point_sites.items():
            param = self._params[name]
            values[name] = pyro.param(site, lambda param=param: param.detach().clone())
        for name in self._frozen:  # the module's value, without a gradient
            values[name] = self._params[name].detach()
        # Tied weights: every alias gets the value, so functional_call need not search
        # the module for ties at each call (a walk over all its parameters).
        for name, aliases in self._aliases.items():
            for alias in aliases:
                values[alias] = values[name]
        if batched:
            return self._vectorised(values, batched, args, kwargs)
        return functional_call(self.module, values, args, kwargs, tie_weights=False)

    def _warn_inside_subsampled_plate(self) -> None:
        # Pyro gives a site inside a plate the plate's batch shape: the weights would be
        # one draw per example of the minibatch, each with its prior scaled by N / B.
        for frame in get_plates():
            if frame.full_size is not None and frame.size < frame.full_size:
                warnings.warn(
                    f"lift: {type(self.module).__name__} was called inside "
                    f"pyro.plate({frame.name!r}, {frame.full_size}, subsample_size="
                    f"{frame.size}), so its random weights are drawn once per example of the "
                    f"minibatch with the prior scaled by {frame.full_size}/{frame.size}; call "
                    "the network outside the plate and index its output inside it (or use "
                    "bdl.observe)",
                    stacklevel=3,
                )
                return

    def _vectorised(self, values: dict, batched: list[str], args: tuple, kwargs: dict):
        """The forward for a batch of draws, e.g. from ``Predictive(..., parallel=True)``.

        Pyro's vectorised plate hands each random weight with leading draw dimensions
        (``(S, *shape)``, or ``(S, 1, ..., *shape)``); :func:`torch.func.vmap` runs the
        module once per draw, and every tensor it returns gets the draw dimensions in
        front, where the plate expects them. Non-tensor outputs (a key-value cache) are
        returned as None.
        """
        shapes = {}
        for name in batched:
            value, param = values[name], self._params[name]
            lead = value.shape[: value.dim() - param.dim()]
            if value.dim() < param.dim() or value.shape[len(lead) :] != param.shape:
                raise ValueError(
                    f"{self.prefix + name!r} has shape {tuple(value.shape)}, the parameter "
                    f"{tuple(param.shape)}: a value must be the parameter's shape, or draws "
                    "stacked in front of it"
                )
            while lead and lead[-1] == 1:  # the plate's padding for dims right of it
                lead = lead[:-1]
            shapes[name] = lead
        draws = torch.broadcast_shapes(*shapes.values())
        count = math.prod(draws)
        moving = {}
        for name in batched:
            param = self._params[name]
            value = values[name].reshape(*shapes[name], *param.shape)
            moving[name] = value.expand(*draws, *param.shape).reshape(count, *param.shape)
        for name, aliases in self._aliases.items():
            for alias in aliases:
                if name in moving:
                    moving[alias] = moving[name]
        fixed = {name: value for name, value in values.items() if name not in moving}
        structure = {}

        def one_draw(draw: dict) -> tuple:
            output = functional_call(
                self.module, {**fixed, **draw}, args, kwargs, tie_weights=False
            )
            leaves, structure["spec"] = tree_flatten(output)
            structure["is_tensor"] = [torch.is_tensor(leaf) for leaf in leaves]
            return tuple(leaf for leaf in leaves if torch.is_tensor(leaf))

        try:
            outputs = torch.func.vmap(one_draw, randomness="different")(moving)
        except Exception as error:  # any failure inside vmap: name the way out
            raise RuntimeError(
                f"lift: {count} draws of the weights reached {type(self.module).__name__} at "
                "once (Predictive(..., parallel=True) or a vectorised plate around the model), "
                f"and its forward could not be vectorised over them with torch.func.vmap "
                f"({type(error).__name__}: {error}); use Predictive(..., parallel=False)"
            ) from error
        tensors = iter(output.reshape(*draws, *output.shape[1:]) for output in outputs)
        leaves = [next(tensors) if is_tensor else None for is_tensor in structure["is_tensor"]]
        return tree_unflatten(leaves, structure["spec"])

    @contextlib.contextmanager
    def fixed(
        self, values: Mapping[str, torch.Tensor], *, strict: bool = True
    ) -> Iterator[LiftedModule]:
        """A context in which every forward call of the module uses one given draw.

        ``values`` maps site names to tensors (one draw, e.g.
        ``{k: v[i] for k, v in mcmc.get_samples().items()}``); a key that is not a site of
        this module is an error (a misspelt site would otherwise keep the module's own
        weight), unless ``strict=False``, which ignores it (a draw of a larger model). Point
        weights missing from ``values`` take their value from Pyro's param store when it
        has one. Inside the context the wrapper and any method of the module
        (``generate`` included) run without sample sites; the module's own weights are
        restored on exit.

        :param dict values: one value per random site, keyed by site name.
        :param bool strict: refuse keys that are not sites of this module.
        """
        if strict:
            sites = [*self.random_sites, *self.point_sites]
            site_keys("fixed(values)", values, sites, "the lifted module's sites")
        missing = [site for site in self.random_sites if site not in values]
        if missing:
            raise KeyError(
                f"fixed(values): no value for the random sites {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}; pass one draw of every random site"
            )
        store = pyro.get_param_store()
        chosen = {name: values[site] for site, name in self.random_sites.items()}
        for site, name in self.point_sites.items():
            if site in values:
                chosen[name] = values[site]
            elif site in store:
                chosen[name] = store[site]
        saved = {}
        with torch.no_grad():
            for name, value in chosen.items():
                param = self._params[name]
                if value.shape != param.shape:
                    raise ValueError(
                        f"fixed(values): {self.prefix + name!r} has shape {tuple(value.shape)}, "
                        f"expected {tuple(param.shape)}; pass a single draw, not a batch"
                    )
                saved[name] = param.detach().clone()
                param.copy_(value)
        self._fixed_depth += 1
        try:
            yield self
        finally:
            self._fixed_depth -= 1
            with torch.no_grad():
                for name, value in saved.items():
                    self._params[name].copy_(value)

    def __repr__(self) -> str:
        return (
            f"LiftedModule({type(self.module).__name__}, random={len(self.random_sites)} "
            f"tensors, point={len(self.point_sites)} tensors, prior={self._prior!r})"
        )


def _aliases(module: torch.nn.Module, names: Sequence[str]) -> dict[str, list[str]]:
    """For each chosen parameter, the other names under which the module holds it."""
    by_tensor: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    chosen = {}
    for name in names:
        others = [n for n in by_tensor[id(module.get_parameter(name))] if n != name]
        if others:
            chosen[name] = others
    return chosen


def lift(
    module: torch.nn.Module,
    prior: Prior | None = None,
    random: Selector = None,
    point: Selector = None,
    *,
    prefix: str = "",
    frozen: Selector = None,
) -> LiftedModule:
    """Make chosen weights of ``module`` Pyro sites, keeping the module unchanged.

    Parameters are selected among the module's *trainable* parameters
    (``requires_grad=True``) by a substring of their name, a list of names, or a
    predicate ``(name, param) -> bool``. By default every trainable parameter that is
    not ``point`` or ``frozen`` is random. A trainable parameter that is none of the
    three would keep its current value in every method while still getting gradients
    (a new classification head left at its random initialisation): ``lift`` warns and
    names it.

    Example::

        # peft's LoRA for classification: the adapters and the new head are trainable
        net = bdl.lift(peft_model, prior=bdl.priors.IIDNormal(scale=0.2),
                       random=lambda name, param: "lora_" in name or "classifier" in name)

        def model(batch, num_data):
            logits = net(input_ids=batch["input_ids"]).logits
            bdl.observe("y", dist.Categorical(logits=logits), batch["labels"], num_data)

    :param torch.nn.Module module: any module, e.g. a peft ``PeftModel``.
    :param prior: the prior of the random weights (default ``IIDNormal(1.0)``); any
        object with ``distribution(name, param)``, see :mod:`pyro_bdl.priors`.
    :param random: which trainable parameters get a prior and a ``pyro.sample`` site.
    :param point: which trainable parameters are point estimates read with ``pyro.param``.
    :param str prefix: prepended to every site name (to lift two modules in one model).
    :param frozen: which trainable parameters to hold at the module's current values,
        like ``requires_grad=False`` ones, without changing the module (e.g. the LoRA
        adapters of a last-layer Laplace).
    :return: a callable :class:`LiftedModule`.
    """
    instance("module", module, torch.nn.Module, "a torch.nn.Module")
    instance("prefix", prefix, str, "a string")
    trainable = {name: p for name, p in module.named_parameters() if p.requires_grad}
    if not trainable:
        raise ValueError(
            f"lift: {type(module).__name__} has no trainable parameters (every one has "
            "requires_grad=False), so there is nothing to make random or point"
        )
    aliases = _tied_names(module)
    point_names = _selector_matches(point, "point", trainable, aliases)
    frozen_names = _selector_matches(frozen, "frozen", trainable, aliases)
    if random is None:
        chosen = set(point_names) | set(frozen_names)
        random_names = [name for name in trainable if name not in chosen]
    else:
        random_names = _selector_matches(random, "random", trainable, aliases)
    for first, second, a, b in (
        ("random", "point", random_names, point_names),
        ("random", "frozen", random_names, frozen_names),
        ("point", "frozen", point_names, frozen_names),
    ):
        overlap = sorted(set(a) & set(b))
        if overlap:
            raise ValueError(
                f"lift: parameters selected as both {first} and {second}: {overlap[:5]}; a "
                "weight is one of a sample site (random), a pyro.param (point) or frozen"
            )
    chosen = set(random_names) | set(point_names) | set(frozen_names)
    left = [name for name in trainable if name not in chosen]
    if left:
        warnings.warn(
            f"lift: {len(left)} trainable parameters of {type(module).__name__} are neither "
            f"random, point nor frozen: {left[:5]}{' ...' if len(left) > 5 else ''}. No "
            "method learns them: they keep their current values (a new classification head "
            "stays at its random initialisation). Select them with random= or point= to "
            "learn them, "
            "or frozen= to keep them on purpose",
            stacklevel=2,
        )
    return LiftedModule(
        module,
        IIDNormal(1.0) if prior is None else prior,
        random_names,
        point_names,
        prefix,
        [*frozen_names, *left],
    )


def _describe(value: object) -> str:
    if isinstance(value, type):
        return f"the class {value.__name__} (pass an instance)"
    return f"{type(value).__name__} {value!r:.60}"


def _tied_names(module: torch.nn.Module) -> dict[str, str]:
    """Each second name of a tied parameter -> the name ``named_parameters()`` gives it."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


@contextlib.contextmanager
def recording_calls() -> Iterator[list[LiftedModule]]:
    """The lifted networks called inside the context, in the order of their first call.

    How a guide finds the networks of a model that is any callable (BLoB's flipout hooks,
    the peft adapter ``bdl.save`` writes).
    """
    called: list[LiftedModule] = []
    call = LiftedModule.__call__

    def recording(net, *args, **kwargs):
        if not any(net is seen for seen in called):
            called.append(net)
        return call(net, *args, **kwargs)

    LiftedModule.__call__ = recording
    try:
        yield called
    finally:
        LiftedModule.__call__ = call


def parameter_owner(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """The submodule of ``module`` that holds the parameter at path ``name``, and its attribute."""
    module_path, _, attribute = name.rpartition(".")
    return module.get_submodule(module_path), attribute
