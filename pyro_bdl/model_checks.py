r"""The checks every method runs on the model once, when it sets up: Pyro's and a little more.

Pyro's ELBOs check each site of a traced model with :func:`pyro.util.check_site_shape`: a
log density whose shape does not match the site's plates is an error there, whereas its
MCMC kernels and its ``Predictive`` check nothing. A model that observes labels of shape
``(N, 1)`` against a distribution of batch shape ``(N,)`` inside ``pyro.plate("data",
N)`` broadcasts into an ``(N, N)`` log likelihood that scores every label against every
prediction; without the check a fit returns weights near the prior and says nothing. Every
method of pyro_bdl therefore runs :func:`check_model` on the trace it makes anyway when it
sets up (a guide's prototype trace, a kernel's first trace, the first draw of a
prediction): no extra forward pass, nothing per step.

* **Shapes** (:func:`check_site_shapes`): a site inside vectorised plates is checked as
  ``Trace_ELBO`` checks it, ``check_site_shape`` at ``max_plate_nesting=inf``: a dimension
  of its log density left of its plates is refused. A site outside every plate keeps any
  batch shape, as NUTS allows (Pyro's eight schools example has one), but not a value that
  broadcasts against its distribution into a larger shape than either, the same ``(N, N)``
  grid without a plate (this goes beyond Pyro, which refuses only the former, and only
  in SVI). The error, :class:`SiteShapeError`, names the site, both shapes, the plates,
  and the fix (usually ``y.squeeze(-1)``).
* **An observed-looking latent** (:func:`warn_observed_looking`): a latent site in a
  vectorised plate in which nothing is observed, shaped like a tensor the model was given,
  is almost always data whose ``obs=`` was forgotten (and a :func:`~pyro_bdl.observe` site
  without ``obs`` during a fit is one for certain). Every method then fits the prior and
  never sees the data, each failing in its own way later (a Laplace mode that is not
  positive definite, IVON asking for ``num_data``, a chain that does not mix, a mean-field
  fit that looks fine); :class:`ObservedLookingLatentWarning` names the site first.
* **Model and guide** (:func:`check_model_guide`): a prediction from a guide runs
  ``check_model_guide_match``, as ``Trace_ELBO`` does, so a latent site the guide does not
  cover (drawn from its prior at every draw) or a site whose shapes disagree is said.

Guides get the first two through :class:`CheckedPrototype`, the SGMCMC kernels from their
model set-up, :func:`~pyro_bdl.inference.fit_map` and the baselines from their guide's
set-up, and :func:`~pyro_bdl.predict.predict_proba` checks the first draw.

Example::

    trace = pyro.poutine.trace(model).get_trace(x, y)
    check_model(trace, (x, y), {}, caller="my_fit")   # SiteShapeError for y of shape (N, 1)
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Collection, Iterable, Iterator, Mapping

import pyro
import torch
from pyro.poutine.util import site_is_subsample
from pyro.util import check_model_guide_match, check_site_shape

from pyro_bdl.likelihoods import NUM_DATA_KEY

__all__ = [
    "SiteShapeError",
    "ObservedLookingLatentWarning",
    "CheckedPrototype",
    "check_model",
    "check_site_shapes",
    "warn_observed_looking",
    "check_model_guide",
    "max_plate_nesting",
]

Sites = pyro.poutine.Trace | Iterable[dict]


class SiteShapeError(ValueError):
    """A site's log density does not have the shape its plates give it.

    :ivar str site: the site's name (None where Pyro's trace re-raised the error, which
        keeps the message only).
    :ivar tuple log_prob_shape: the shape its log density has.
    """

    def __init__(self, message: str, site: str | None = None, log_prob_shape=()):
        super().__init__(message)
        self.site = site
        self.log_prob_shape = tuple(log_prob_shape)


class ObservedLookingLatentWarning(UserWarning):
    """A latent site looks like data whose ``obs=`` was forgotten."""


def check_model(sites: Sites, args: tuple, kwargs: dict, caller: str) -> None:
    """The checks of a fit's set-up: :func:`check_site_shapes`, then
    :func:`warn_observed_looking`.

    :param sites: a trace of the model (observed sites included), or its sample sites'
        messages.
    :param tuple args: the model's arguments in that run.
    :param dict kwargs: its keyword arguments.
    :param str caller: the method, named in the messages.
    :raises SiteShapeError: a site whose log density does not fit its plates.
    """
    sites = list(_sample_sites(sites))
    check_site_shapes(sites, caller)
    warn_observed_looking(sites, args, kwargs, caller)


def max_plate_nesting(sites: Sites) -> int:
    """How many plates deep the sites go (Pyro's guess of ``max_plate_nesting``)."""
    return max((-frame.dim for site in _sample_sites(sites) for frame in _plates(site)), default=0)


def check_site_shapes(sites: Sites, caller: str) -> None:
    """Refuse a site whose log density does not have the shape its plates give it.

    A site inside vectorised plates is checked by :func:`pyro.util.check_site_shape` at
    ``max_plate_nesting=inf``, as ``Trace_ELBO`` checks it; any site, in plates or not, whose
    value and distribution broadcast into a shape larger than either is refused too. The
    log densities' shapes are worked out, not computed: nothing is evaluated.

    :param sites: a trace of the model, or its sample sites' messages.
    :param str caller: the method, named in the message.
    :raises SiteShapeError: naming the site, its shapes, its plates and the fix.
    """
    for site in _sample_sites(sites):
        value, fn = site["value"], site["fn"]
        if not torch.is_tensor(value) or not hasattr(fn, "batch_shape"):
            continue
        event_dim = len(fn.event_shape)
        value_batch = value.shape[: max(value.dim() - event_dim, 0)]
        shape = _broadcast(value_batch, fn.batch_shape)
        if shape is None:  # the distribution's own log_prob names this mismatch
            continue
        grid = shape not in (value_batch, fn.batch_shape)
        if _plates(site):
            try:
                check_site_shape({**site, "log_prob": torch.empty(shape, device="meta")}, math.inf)
            except ValueError as error:
                raise _shape_error(caller, site, shape, value_batch, str(error)) from None
        if grid:
            raise _shape_error(caller, site, shape, value_batch, "")


def warn_observed_looking(sites: Sites, args: tuple, kwargs: dict, caller: str) -> list[str]:
    """Warn about each latent site that looks like data whose ``obs=`` was forgotten.

    Such a site sits in a vectorised plate in which no site is observed and has the shape of
    a tensor among the model's arguments (or that tensor's without a trailing 1), or it was
    made by :func:`~pyro_bdl.observe` without ``obs``.

    :param sites: a trace of the model, or its sample sites' messages.
    :param tuple args: the model's arguments in that run.
    :param dict kwargs: its keyword arguments.
    :param str caller: the method, named in the message.
    :return: the names of the sites warned about.
    """
    sites = list(_sample_sites(sites))
    observed_plates = {f.name for s in sites if s["is_observed"] for f in _plates(s)}
    tensors = list(_tensors(("args", tuple(args)), ("kwargs", dict(kwargs))))
    named = []
    for site in sites:
        if site["is_observed"]:
            continue
        if NUM_DATA_KEY in site["infer"]:
            _warn(caller, site, "was made by bdl.observe without obs", "obs=<the labels>")
            named.append(site["name"])
            continue
        plates = [f for f in _plates(site) if f.name not in observed_plates]
        if not plates:
            continue
        shape = tuple(site["value"].shape)
        for where, tensor in tensors:
            shapes = {tuple(tensor.shape)}
            if tensor.dim() and tensor.shape[-1] == 1:
                shapes.add(tuple(tensor.shape[:-1]))
            sized = any((f.full_size or f.size) in tensor.shape for f in plates)
            if shape in shapes and sized:
                plate = plates[0]
                size = plate.full_size or plate.size
                reason = (
                    f"sits in the plate {plate.name!r} of size {size}, in which nothing is "
                    f"observed, and has the shape {shape} of the data the model was given "
                    f"({where})"
                )
                _warn(caller, site, reason, f"obs=<the tensor at {where}>")
                named.append(site["name"])
                break
    return named


def check_model_guide(
    model_trace: pyro.poutine.Trace,
    guide_trace: pyro.poutine.Trace,
    caller: str,
    observed: Collection[str] | None = None,
) -> None:
    """Check a model traced on a guide's draw: :func:`check_site_shapes`, Pyro's
    ``check_model_guide_match`` (with the model's :func:`max_plate_nesting`), and the latent
    sites of the model that the guide does not sample.

    Such a site is drawn from its prior at every draw. A prediction leaves the observation
    unobserved, so it is a latent site the guide does not sample by design: the sites
    ``observed`` names (those a :class:`CheckedPrototype` guide saw observed when it set
    up) and those of :func:`~pyro_bdl.observe` are not reported. With ``observed=None`` (a
    guide that does not say) none is.

    :param str caller: the method, named in the messages.
    :param observed: the names of the sites the guide's model observed when it was fitted.
    :raises SiteShapeError: a site of the model whose log density does not fit its plates.
    :raises ValueError: a site whose model and guide shapes disagree (Pyro's message).
    """
    check_site_shapes(model_trace, caller)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its warning about unmatched sites: said below
        check_model_guide_match(model_trace, guide_trace, max_plate_nesting(model_trace))
    if observed is None:
        return
    sampled = {name for name, site in guide_trace.nodes.items() if site["type"] == "sample"}
    missing = [
        site["name"]
        for site in _sample_sites(model_trace)
        if not site["is_observed"]
        and site["name"] not in sampled
        and site["name"] not in observed
        and NUM_DATA_KEY not in site["infer"]
    ]
    if missing:
        warnings.warn(
            f"{caller}: the guide does not sample the model's latent site(s) {missing}, so "
            "they are drawn from their priors at every draw: predict with the guide fitted "
            "to this model",
            UserWarning,
            stacklevel=4,
        )


class CheckedPrototype:
    """Mixin of an :class:`~pyro.infer.autoguide.AutoGuide`: its prototype trace runs
    :func:`check_model`.

    Pyro's prototype run hides the observed sites from the trace; the mixin keeps their
    messages as the run passes them (through ``_prototype_hide_fn``), checks them with the
    latent sites once the run is over, records the model's :func:`max_plate_nesting`, and
    drops them (an observed site's distribution may hold a batch of logits). A guide that
    reads the observed sites too overrides ``_read_observed(observed)``.

    :ivar int max_plate_nesting: how many plates deep the model's sites go (after set-up).
    :ivar frozenset observed_sites: the names of the sites the model observed (after set-up).
    """

    #: Whether the set-up checks the model (False where another guide of the same fit
    #: already did).
    _checks_model = True
    #: The method named in the messages (default: the guide's class).
    _checked_by: str | None = None
    _observed_messages: list[dict] | None = None
    max_plate_nesting: int | None = None
    observed_sites: frozenset[str] = frozenset()

    def _setup_prototype(self, *args, **kwargs) -> None:
        with self._checked_run(args, kwargs):
            super()._setup_prototype(*args, **kwargs)

    @contextlib.contextmanager
    def _checked_run(self, args: tuple, kwargs: dict) -> Iterator[None]:
        """Check the model once the prototype run inside the block is over."""
        self._observed_messages = []
        try:
            yield
            sites = [*self.prototype_trace.nodes.values(), *self._observed_messages]
            self.max_plate_nesting = max_plate_nesting(sites)
            self.observed_sites = frozenset(msg["name"] for msg in self._observed_messages)
            if self._checks_model:
                check_model(sites, args, kwargs, self._checked_by or type(self).__name__)
            self._read_observed(self._observed_messages)
        finally:
            self._observed_messages = None

    def _prototype_hide_fn(self, msg: dict) -> bool:
        if msg["type"] == "sample" and msg["is_observed"] and self._observed_messages is not None:
            self._observed_messages.append(msg)
        return super()._prototype_hide_fn(msg)

    def _read_observed(self, observed: list[dict]) -> None:
        """Read what the guide needs of the model's observed sites (default: nothing).

        :param list observed: the observed sites' messages of the prototype run.
        """


# -- helpers ---------------------------------------------------------------------------------


def _sample_sites(sites: Sites) -> Iterator[dict]:
    nodes = sites.nodes.values() if isinstance(sites, pyro.poutine.Trace) else sites
    for site in nodes:
        if site["type"] == "sample" and not site_is_subsample(site):
            yield site


def _broadcast(*shapes) -> torch.Size | None:
    try:
        return torch.broadcast_shapes(*shapes)
    except RuntimeError:
        return None


def _plates(site: dict) -> list:
    return [f for f in site["cond_indep_stack"] if f.vectorized and f.dim is not None]


def _plates_shape(site: dict) -> str:
    """The shape the plates give a log density, ``*`` for a dimension they leave free."""
    plates = _plates(site)
    if not plates:
        return "()"
    sizes = ["*"] * max(-f.dim for f in plates)
    for f in plates:
        sizes[f.dim] = str(f.size)
    return f"({', '.join(sizes)}{',' if len(sizes) == 1 else ''})"


def _shape_error(caller: str, site: dict, shape, value_batch, pyro_says: str) -> SiteShapeError:
    name, fn, value = site["name"], site["fn"], site["value"]
    kind = "observed" if site["is_observed"] else "latent"
    plates = ", ".join(f"{f.name!r} of size {f.size} at dim {f.dim}" for f in _plates(site))
    where = f"its plates ({plates}) give it {_plates_shape(site)}" if plates else "no plate"
    if shape not in (value_batch, fn.batch_shape):
        cause = (
            f"its value of shape {tuple(value.shape)} and its distribution's batch shape "
            f"{tuple(fn.batch_shape)} broadcast against each other into {tuple(shape)}, so "
            "that every value is scored against every entry of the distribution"
        )
    else:
        cause = (
            f"its value has shape {tuple(value.shape)} and its distribution batch shape "
            f"{tuple(fn.batch_shape)} (event shape {tuple(fn.event_shape)})"
        )
    fix = _fix(site, value_batch)
    message = (
        f"{caller}: the {kind} site {name!r} has a log density of shape {tuple(shape)}, but "
        f"{where}: {cause}. {fix}"
    )
    if pyro_says and shape in (value_batch, fn.batch_shape):  # else the grid says it all
        message += f"\n(Pyro's check_site_shape: {' '.join(pyro_says.split())})"
    return SiteShapeError(message, name, shape)


def _fix(site: dict, value_batch) -> str:
    name, fn, value = site["name"], site["fn"], site["value"]
    if value.dim() and value.shape[-1] == 1 and len(value_batch) > len(fn.batch_shape):
        squeezed = value.shape[:-1]
        squeezed_batch = squeezed[: len(squeezed) - len(fn.event_shape)]
        if _broadcast(squeezed_batch, fn.batch_shape) == fn.batch_shape:
            what = "observed value" if site["is_observed"] else "value"
            return (
                f"Give the {what} the distribution's shape {tuple(squeezed)} by dropping its "
                f"trailing 1: pyro.sample({name!r}, ..., obs=y.squeeze(-1)) for a y of shape "
                f"{tuple(value.shape)}"
            )
    return (
        "Give the value and the distribution the shape of the plates: squeeze a trailing "
        "dimension of 1 (y.squeeze(-1) for labels of shape (N, 1), mean.squeeze(-1) for a "
        "network output of shape (N, 1)), make a dimension that belongs to one example an "
        "event dimension with .to_event(1), or enclose the batch in pyro.plate(...)"
    )


def _warn(caller: str, site: dict, reason: str, obs: str) -> None:
    warnings.warn(
        f"{caller}: the latent site {site['name']!r} {reason}: it looks like data whose obs= "
        f"was forgotten. As a latent site it is fitted, not conditioned on, and the fit never "
        f"sees the data: pass pyro.sample({site['name']!r}, ..., {obs}). If it is meant as a "
        "latent per example, silence this with warnings.filterwarnings('ignore', "
        "category=pyro_bdl.model_checks.ObservedLookingLatentWarning)",
        ObservedLookingLatentWarning,
        stacklevel=4,
    )


def _tensors(*items: tuple[str, object], depth: int = 3) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors among the model's arguments (inside tuples, lists and dicts), with where."""
    for where, value in items:
        if torch.is_tensor(value):
            yield where, value
            continue
        if not depth:
            continue
        if isinstance(value, Mapping):
            inner = [(f"{where}[{key!r}]", entry) for key, entry in value.items()]
        elif isinstance(value, (tuple, list)):
            inner = [(f"{where}[{i}]", entry) for i, entry in enumerate(value)]
        else:
            continue
        yield from _tensors(*inner, depth=depth - 1)
