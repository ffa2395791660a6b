r"""Per-example gradients of a Pyro model's output along chosen cotangents.

Every Laplace quantity is built from :math:`g_{c,i} = J_i^\top v_{c,i}`: the gradient,
for example :math:`i`, of the model output contracted with a cotangent column
:math:`v_c` (a column of the likelihood Hessian's square root for the curvature, a unit
vector per class for the linearised predictive), with respect to each latent site.
One forward pass and one backward pass per column give them for a whole batch:

* a site used as the weight or bias of :func:`torch.nn.functional.linear` (every
  ``nn.Linear``, LoRA's A and B included) is handled in factored form. A
  :class:`~torch.overrides.TorchFunctionMode` records each call's input :math:`a` and
  output :math:`s`; the backward pass gives :math:`b = \partial (v^\top f) / \partial s`
  for the whole batch, and :math:`g_i = \sum_t b_{i,t} a_{i,t}^\top` sums over the
  positions :math:`t` that share the weight (tokens, time steps, repeated calls).
  K-FAC uses :math:`a` and :math:`b` directly. Recording calls rather than hooking
  modules needs no handle on the network, so it serves lifted modules and plain
  ``pyro.sample`` weights alike;
* so are ``x @ W.T`` and ``addmm(c, x, W.T)`` (a hand-written LSTM's recurrence) and a
  convolution, a linear map of its unfolded input patches (KFC, Grosse and Martens 2016);
* a site used as the table of :func:`torch.nn.functional.embedding` is handled the
  same way: :math:`g_i` adds the output gradients :math:`b_{i,t}` into the rows of the
  example's tokens, a sparse matrix never formed densely (an embedding table is most of
  the CNN-LSTM's 2.7M weights);
* any other site gets dense per-example gradients from :func:`torch.func.vmap` over
  examples of :func:`torch.func.vjp` of the model run on one example (the model must
  be vmappable, as the hand-written CNN-LSTM is); if vmap fails, one example at a time.

Before trusting the factored form for a site, the first batch checks that the summed
per-example gradients equal autograd's gradient of the site; a weight that is also used
outside ``linear`` or ``embedding`` (tied weights, say) falls back to the dense path.

Where each recorded call feeds one entry of the model's return value (a
:class:`~pyro_bdl.models.ChoiceTexts`, whose choices run through the LM one at a time),
one backward pass serves every column: the first batch finds which entry each call
feeds and checks the result against the passes per column.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pyro
import torch
import torch.nn.functional as F
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from pyro_bdl.inference.laplace.observation import Observation, StructureError

__all__ = [
    "ModelJacobians",
    "Linearization",
    "SiteGradient",
    "LinearGradient",
    "EmbeddingGradient",
    "DenseGradient",
]


#: Output entries per example up to which a model is checked for calls that feed one
#: entry each (:meth:`Linearization._separable_backward`); the check costs one backward
#: pass per entry, once.
MAX_SEPARABLE_ENTRIES = 16


class SiteGradient:
    """The gradients of ``m`` columns for each of ``B`` examples, for one site."""

    def per_example(self) -> torch.Tensor:
        """Dense gradients, shaped ``(m, B, *site_shape)``."""
        raise NotImplementedError

    def total(self, column: int) -> torch.Tensor:
        """:math:`\\sum_i g_{c,i}` for one column ``c``, shaped like the site."""
        return self.per_example()[column].sum(0)

    def sum_of_squares(self) -> torch.Tensor:
        """:math:`\\sum_{c,i} g_{c,i}^2`, shaped like the site."""
        return self.per_example().square().sum((0, 1))

    def gram(self, weight: torch.Tensor) -> torch.Tensor:
        """:math:`\\sum_\\theta w_\\theta g_{c,i}(\\theta) g_{d,i}(\\theta)`, shaped ``(B, m, m)``.

        :param torch.Tensor weight: broadcastable to the site's shape.
        """
        grads = self.per_example()
        weight = weight.expand(grads.shape[2:]).reshape(-1)
        grads = grads.reshape(*grads.shape[:2], -1)  # a 0-d site's grads are (m, B)
        return torch.einsum("cbp,dbp->bcd", grads * weight, grads)


@dataclass
class DenseGradient(SiteGradient):
    """Per-example gradients held densely, ``(m, B, *site_shape)``."""

    grads: torch.Tensor

    def per_example(self) -> torch.Tensor:
        return self.grads


@dataclass
class LinearGradient(SiteGradient):
    """The factored gradients of a weight (or bias) shared over positions.

    :ivar inputs: :math:`a`, shaped ``(B, T, d_in)`` (a convolution's unfolded input
        patches); None for a bias.
    :ivar output_grads: :math:`b`, shaped ``(m, B, T, d_out)``.
    :ivar shape: the site's shape, if not ``(d_out, d_in)`` (a convolution kernel).
    """

    inputs: torch.Tensor | None
    output_grads: torch.Tensor
    shape: torch.Size | None = None

    def _site(self, matrix: torch.Tensor) -> torch.Tensor:
        return matrix if self.shape is None else matrix.reshape(*matrix.shape[:-2], *self.shape)

    def _matrix(self, weight: torch.Tensor) -> torch.Tensor:
        d_out, d_in = self.output_grads.shape[-1], self.inputs.shape[-1]
        return weight.expand(self.shape or (d_out, d_in)).reshape(d_out, d_in)

    def per_example(self) -> torch.Tensor:
        if self.inputs is None:
            return self.output_grads.sum(2)
        return self._site(torch.einsum("cbto,bti->cboi", self.output_grads, self.inputs))

    def total(self, column):
        if self.inputs is None:
            return self.output_grads[column].sum((0, 1))
        return self._site(torch.einsum("bto,bti->oi", self.output_grads[column], self.inputs))

    def sum_of_squares(self) -> torch.Tensor:
        if self.inputs is None or self.inputs.shape[1] > 1:
            return super().sum_of_squares()
        # One position: g = b a^T, so g^2 = b^2 (a^2)^T without forming g.
        b, a = self.output_grads[:, :, 0], self.inputs[:, 0]
        return self._site(torch.einsum("cbo,bi->oi", b.square(), a.square()))

    def gram(self, weight: torch.Tensor) -> torch.Tensor:
        if self.inputs is None or self.inputs.shape[1] > 1:
            return super().gram(weight)
        b, a = self.output_grads[:, :, 0], self.inputs[:, 0]
        return torch.einsum("cbo,dbo,oi,bi->bcd", b, b, self._matrix(weight), a.square())


@dataclass
class EmbeddingGradient(SiteGradient):
    """The factored gradients of an ``embedding`` table: sparse rows per example.

    :ivar indices: the looked-up rows, ``(B, T)``.
    :ivar output_grads: :math:`b`, shaped ``(m, B, T, d)``.
    :ivar int num_embeddings: rows of the table.
    """

    indices: torch.Tensor
    output_grads: torch.Tensor
    num_embeddings: int

    @functools.cached_property
    def _rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(example, row, gradient) of every distinct (example, row) pair."""
        columns, batch, positions, dim = self.output_grads.shape
        example = torch.arange(batch, device=self.indices.device).unsqueeze(1)
        keys = (example * self.num_embeddings + self.indices).reshape(-1)
        unique, inverse = torch.unique(keys, return_inverse=True)
        grads = self.output_grads.new_zeros(columns, len(unique), dim)
        grads.index_add_(1, inverse, self.output_grads.reshape(columns, -1, dim))
        return unique // self.num_embeddings, unique % self.num_embeddings, grads

    def per_example(self):
        example, row, grads = self._rows
        columns, batch, _, dim = self.output_grads.shape
        dense = grads.new_zeros(columns, batch, self.num_embeddings, dim)
        dense[:, example, row] = grads
        return dense

    def total(self, column):
        dim = self.output_grads.shape[-1]
        table = self.output_grads.new_zeros(self.num_embeddings, dim)
        return table.index_add_(
            0, self.indices.reshape(-1), self.output_grads[column].reshape(-1, dim)
        )

    def sum_of_squares(self):
        _, row, grads = self._rows
        table = grads.new_zeros(self.num_embeddings, grads.shape[-1])
        return table.index_add_(0, row, grads.square().sum(0))

    def gram(self, weight):
        example, row, grads = self._rows
        columns, batch = self.output_grads.shape[:2]
        weight = weight.expand(self.num_embeddings, grads.shape[-1])[row]
        per_row = torch.einsum("cud,ud,eud->uce", grads, weight, grads)
        return per_row.new_zeros(batch, columns, columns).index_add_(0, example, per_row)


class _RunAt(Messenger):
    """Run a model with its latent sites at given values; keep its other sample sites."""

    def __init__(self, values: dict[str, torch.Tensor]):
        super().__init__()
        self.values = values
        self.observed: list[dict] = []
        self._observation: Observation | None = None

    def _pyro_sample(self, msg: dict) -> None:
        if site_is_subsample(msg) or msg["infer"].get("_deterministic"):
            return
        if msg["name"] in self.values and not msg["is_observed"]:
            msg["value"] = self.values[msg["name"]]
            msg["is_observed"] = True
        else:
            self.observed.append(msg)

    def observation(self) -> Observation:
        """The likelihood of the run's one observed site (built once)."""
        if self._observation is None:
            if len(self.observed) != 1:
                names = [msg["name"] for msg in self.observed]
                raise StructureError(
                    "LaplaceGuide's GGN and Fisher curvatures need a model with exactly one "
                    f"observed site (one bdl.observe call) besides its latent sites, found {names}"
                )
            self._observation = Observation(self.observed[0])
        return self._observation


@dataclass
class _Call:
    """One use of a latent site that has a factored gradient.

    ``kind`` is ``"linear"`` (``linear``, or ``addmm``/``matmul`` by a site's transpose),
    ``"conv"`` (a linear map of unfolded patches), ``"embedding"``, or ``"other"`` (a use
    we cannot factor, which makes its sites dense).
    """

    kind: str
    weight_site: str | None
    bias_site: str | None
    inputs: torch.Tensor  # activations a, a convolution's input, or embedding indices
    output: torch.Tensor
    version: int
    options: dict


_CONVOLUTIONS = {F.conv1d: 1, F.conv2d: 2}
_PRODUCTS = (torch.addmm, torch.matmul, torch.Tensor.matmul)
_SIGNATURES = {
    F.linear: ("input", "weight", "bias"),
    F.embedding: ("input", "weight", "padding_idx"),
    torch.addmm: ("bias", "input", "weight"),
    torch.matmul: ("input", "weight"),
    torch.Tensor.matmul: ("input", "weight"),
    F.conv1d: ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
    F.conv2d: ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
}


class _RecordCalls(TorchFunctionMode):
    """Record every use of a site's value whose per-example gradient has a factored form."""

    def __init__(self, sites_by_id: dict[int, str]):
        super().__init__()
        self.sites_by_id = sites_by_id
        self.calls: list[_Call] = []
        # id of a transposed site -> (site, the view: kept alive, so its id stays unique)
        self.transposed: dict[int, tuple[str, torch.Tensor]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every torch call of the model passes here: the common case (an operation that
        # is neither recorded nor a transpose) does two hash look-ups and nothing else.
        output = func(*args, **kwargs) if kwargs else func(*args)
        if func in _SIGNATURES:
            bound = dict(zip(_SIGNATURES[func], args))
            if kwargs:
                bound.update(kwargs)
            self._record(func, bound, output)
        elif func in _TRANSPOSES and args and id(args[0]) in self.sites_by_id:
            if args[0].dim() == 2:
                self.transposed[id(output)] = (self.sites_by_id[id(args[0])], output)
        return output

    def _record(self, func, bound: dict, output: torch.Tensor) -> None:
        if func in _PRODUCTS:  # x @ W.T (+ c) is linear(x, W) (+ c): an LSTM's recurrence
            weight_site = self.transposed.get(id(bound["weight"]), (None,))[0]
            kind = "linear" if bound["input"].dim() >= 2 else "other"
        else:
            weight_site = self.sites_by_id.get(id(bound["weight"]))
            kind = "embedding" if func is F.embedding else "linear"
            if bound["weight"].dim() != 2:  # linear(x, w) with a vector w: no factored form
                kind = "other"
        bias = bound.get("bias")
        bias_site = None if bias is None else self.sites_by_id.get(id(bias))
        if not (weight_site or bias_site):
            return
        options = {}
        if func in _CONVOLUTIONS:
            options = _conv_options(bound, _CONVOLUTIONS[func])
            kind = "conv" if options else "other"
        elif func is F.embedding:
            options = {"padding_idx": bound.get("padding_idx")}
        inputs = bound["input"].detach()
        self.calls.append(
            _Call(kind, weight_site, bias_site, inputs, output, output._version, options)
        )


# The transposes of a weight (``W.t()``, ``W.T``) that ``x @ W.T`` uses; ``Tensor.T`` reaches
# the mode as its getter, whose method-wrappers compare equal.
_TRANSPOSES = frozenset({torch.t, torch.Tensor.t, torch.Tensor.T.__get__})


def _conv_options(bound: dict, dims: int) -> dict:
    """The unfolding arguments of a convolution, or {} if it cannot be unfolded."""

    def per_dim(value, default):
        value = default if value is None else value
        return tuple(value) if isinstance(value, (tuple, list)) else (value,) * dims

    padding = bound.get("padding", 0)
    if bound.get("groups", 1) != 1 or isinstance(padding, str):
        return {}
    return {
        "kernel_size": tuple(bound["weight"].shape[2:]),
        "stride": per_dim(bound.get("stride"), 1),
        "padding": per_dim(padding, 0),
        "dilation": per_dim(bound.get("dilation"), 1),
    }


def _patches(inputs: torch.Tensor, options: dict) -> torch.Tensor:
    """A convolution's input as the rows of a linear map: ``(B, positions, C_in * k)``."""
    if inputs.dim() == 3:  # conv1d is a convolution of height 1
        inputs = inputs.unsqueeze(2)
        options = {key: (0 if key == "padding" else 1, *v) for key, v in options.items()}
    return F.unfold(inputs, **options).transpose(1, 2)


def _concatenate(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    # One call needs no copy, and keeps the storage that layers reading the same input
    # share (LoRA's query and value A), which K-FAC uses to compute their factor once.
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _is_example_batched(x, batch_size: int) -> bool:
    return torch.is_tensor(x) and x.dim() > 0 and x.shape[0] == batch_size


class ModelJacobians:
    """Linearise a Pyro model at fixed values of its latent sites, batch by batch.

    Example::

        jacobians = ModelJacobians(model, theta_map)
        run = jacobians(args, kwargs)                 # one forward pass
        columns = run.observation.columns("ggn")      # (m, *f.shape)
        grads = run.gradients(columns)                # site -> SiteGradient

    :param callable model: a Pyro model with one observed site.
    :param dict values: the latent sites' values (the MAP).
    """

    def __init__(self, model: Callable, values: dict[str, torch.Tensor]):
        self.model = model
        self.values = {
            name: value.detach().clone().requires_grad_() for name, value in values.items()
        }
        # site -> whether its factored (linear or embedding) gradients passed the check
        self.factored_verified: dict[str, bool] = {}
        self._vmap_failed = False
        self._batched_backward: bool | None = None  # whether a vmapped backward works
        # Which output entry each recorded call feeds, when each feeds one (ChoiceTexts:
        # a choice's calls feed its score alone): (the calls' sites, the entries), learnt
        # on the first batch; False for a model whose calls feed several.
        self._separable: tuple[tuple, list[int]] | bool | None = None

    def __call__(self, args: tuple, kwargs: dict, output: str = "observation") -> Linearization:
        """Run the model on one batch, recording what the gradients need.

        :param str output: ``"observation"`` differentiates the observed site's natural
            parameter (curvature), ``"return"`` the model's return value (prediction).
        """
        if output not in ("observation", "return"):
            raise ValueError(f"output must be 'observation' or 'return', got {output!r}")
        sites_by_id = {id(value): name for name, value in self.values.items()}
        with torch.enable_grad(), _RecordCalls(sites_by_id) as record, _RunAt(self.values) as run:
            returned = self.model(*args, **kwargs)
        if output == "observation":
            result = run.observation().natural
        elif torch.is_tensor(returned):
            result = returned
        else:
            raise ValueError(
                "the linearised predictive needs a model that returns its output tensor "
                f"(logits shaped (batch, classes)), got {type(returned).__name__}"
            )
        returned = returned if torch.is_tensor(returned) else None
        return Linearization(self, args, kwargs, output, result, run, record.calls, returned)

    def run_output(self, args: tuple, kwargs: dict, values: dict, output: str) -> torch.Tensor:
        """The model's output at ``values`` without recording (for torch.func)."""
        with _RunAt(values) as run:
            returned = self.model(*args, **kwargs)
        return run.observation().natural if output == "observation" else returned


class Linearization:
    """One batch's model run at the latent values of a :class:`ModelJacobians`.

    :ivar torch.Tensor output: the differentiated output :math:`f`, first dim the batch.
    :ivar observation: the :class:`Observation` of the observed site (or None).
    """

    def __init__(self, jacobians, args, kwargs, output_kind, output, run, calls, returned=None):
        self._jacobians = jacobians
        self._returned = returned  # the model's return value (a classifier's raw logits)
        self._args, self._kwargs = args, kwargs
        self._output_kind = output_kind
        self.output = output
        self._run = run
        self.batch_size = output.shape[0]
        self._calls = calls

    @property
    def observation(self) -> Observation:
        """The likelihood of the run's observed site."""
        return self._run.observation()

    def gradients(self, columns: torch.Tensor, keep_graph: bool = False) -> dict[str, SiteGradient]:
        """Per-example gradients of ``columns[c] . output`` for every latent site.

        Call it once per run: the recorded calls are released as it returns, and so is
        the run's autograd graph unless ``keep_graph``.

        :param torch.Tensor columns: ``(m, *output.shape)``.
        :param bool keep_graph: keep the graph, to differentiate the run again.
        """
        if self._calls is None:
            raise RuntimeError("Linearization.gradients: already called for this run")
        jacobians = self._jacobians
        factored_sites = self._factored_sites()
        calls = [c for c in self._calls if factored_sites & {c.weight_site, c.bias_site}]
        unverified = [s for s in factored_sites if s not in jacobians.factored_verified]
        # No argument carries the examples (data in a closure, or indexed by a plate's
        # subsample): dense gradients come from this run's graph, which must stay.
        by_graph = not any(tree_flatten(self._split())[0])
        output_grads, references = (
            self._backward(calls, unverified, columns, keep_graph or by_graph)
            if calls
            else ([], {})
        )
        per_site = self._factored(factored_sites, calls, output_grads)
        for site, reference in references.items():
            summed = per_site[site].total(0)
            reference = torch.zeros_like(summed) if reference is None else reference
            scale = reference.abs().max().item()
            ok = (summed - reference).abs().max().item() <= 1e-3 * scale + 1e-12
            jacobians.factored_verified[site] = ok
            if not ok:
                del per_site[site]
        dense_sites = [s for s in jacobians.values if s not in per_site]
        if dense_sites and by_graph:
            per_site.update(self._by_graph(dense_sites, columns, keep_graph))
        elif dense_sites:
            per_site.update(self._dense(dense_sites, columns))
        # The recorded activations are the caller's now (in per_site) or garbage: a run
        # that is still referenced while the next batch runs must not hold them.
        self._calls = None
        return per_site

    def _backward(self, calls: list[_Call], leaves: list[str], columns: torch.Tensor, keep_graph):
        """Every column's gradient at each call's output, and column 0's at the ``leaves``.

        One backward pass for all columns (``is_grads_batched``: autograd vmapped over
        the cotangents), or one per column where an operation has no batching rule. The
        graph's saved activations are freed as the last pass goes (as in training),
        unless ``keep_graph``: a graph still held when the next batch runs would double
        the activations' memory. A model whose calls each feed one entry of its return
        value (learnt and checked on the first batch) needs one pass whatever the columns
        (:meth:`_separable_backward`).

        :return: per call, the gradients ``(m, *output.shape)``; site -> leaf gradient.
        """
        jacobians = self._jacobians
        entries = self._separable_entries(calls)
        if entries is not None and not leaves:
            return self._separable_backward(calls, columns, entries, keep_graph), {}
        returned = self._returned
        learn = (
            jacobians._separable is None
            and returned is not None
            and returned.requires_grad
            and returned.dim() > 1
            and returned.shape[0] == self.batch_size
            and 1 < returned[0].numel() <= MAX_SEPARABLE_ENTRIES
        )
        per_call, references = self._columns_backward(calls, leaves, columns, keep_graph or learn)
        if learn:
            jacobians._separable = self._learn_separable(calls, columns, per_call, keep_graph)
        return per_call, references

    def _columns_backward(self, calls, leaves, columns, keep_graph, output=None):
        """:meth:`_backward` by one backward pass per column (vmapped where possible), of
        ``output`` (by default the differentiated output)."""
        jacobians = self._jacobians
        output = self.output if output is None else output
        targets = [call.output for call in calls] + [jacobians.values[s] for s in leaves]
        if jacobians._batched_backward is not False:
            try:
                with warnings.catch_warnings():  # a batching rule looped over the columns
                    warnings.filterwarnings("ignore", "There is a performance drop")
                    grads = torch.autograd.grad(
                        output,
                        targets,
                        columns,
                        # a first try that fails needs the graph for the fallback
                        retain_graph=keep_graph or jacobians._batched_backward is None,
                        allow_unused=True,
                        is_grads_batched=True,
                    )
            except RuntimeError:  # no batching rule for some backward: one pass per column
                jacobians._batched_backward = False
            else:
                jacobians._batched_backward = True
                per_call = [
                    columns.new_zeros(len(columns), *call.output.shape) if grad is None else grad
                    for call, grad in zip(calls, grads)
                ]
                first = [None if grad is None else grad[0] for grad in grads[len(calls) :]]
                return per_call, dict(zip(leaves, first))
        per_column = []
        for c in range(len(columns)):
            grads = torch.autograd.grad(
                output,
                targets if c == 0 else targets[: len(calls)],
                columns[c],
                retain_graph=keep_graph or c < len(columns) - 1,
                allow_unused=True,
            )
            per_column.append(grads)
        per_call = [
            torch.stack(
                [
                    torch.zeros_like(call.output) if grads[k] is None else grads[k]
                    for grads in per_column
                ]
            )
            for k, call in enumerate(calls)
        ]
        return per_call, dict(zip(leaves, per_column[0][len(calls) :]))

    def _separable_entries(self, calls: list[_Call]) -> list[int] | None:
        """The entry of the return value that each call feeds, if this model's calls feed
        one each (learnt on an earlier batch, for the same calls in the same order)."""
        learnt = self._jacobians._separable
        if not learnt:
            return None
        sites, entries = learnt
        return entries if sites == tuple((c.weight_site, c.bias_site) for c in calls) else None

    def _learn_separable(self, calls, columns, expected, keep_graph):
        """The entries each call feeds, with the calls' sites, or False.

        One backward pass per entry of the return value finds them (a call's output
        gradient is zero under every entry's cotangent but its own); then
        :meth:`_separable_backward` must give the columns' gradients ``expected`` of the
        passes per column, within the factored form's check (1e-3 of the largest).
        """
        returned = self._returned
        count = returned[0].numel()
        unit = torch.eye(count, dtype=returned.dtype, device=returned.device)
        unit = unit.reshape(count, 1, *returned.shape[1:]).expand(count, *returned.shape)
        probes, _ = self._columns_backward(calls, [], unit, keep_graph=True, output=returned)
        entries = []
        for probe in probes:
            touched = [k for k in range(count) if probe[k].ne(0).any()]
            if len(touched) != 1:  # none: it may feed any entry on another batch
                return False
            entries.append(touched[0])
        found = self._separable_backward(calls, columns, entries, keep_graph)
        for fast, slow in zip(found, expected):
            if (fast - slow).abs().max() > 1e-3 * slow.abs().max() + 1e-12:
                return False
        return tuple((c.weight_site, c.bias_site) for c in calls), entries

    def _separable_backward(self, calls, columns, entries, keep_graph) -> list[torch.Tensor]:
        r"""Every column's gradient at each call's output from one backward pass.

        When call :math:`k` feeds entry :math:`e_k` of the model's return value :math:`r`
        alone, column :math:`v_c`'s gradient at its output is
        :math:`w_{c,i,e_k}\,\partial r_{i,e_k} / \partial s_k` for example :math:`i`, with
        :math:`w_c = (\partial f / \partial r)^\top v_c` pulled back through what lies
        between :math:`r` and the differentiated output :math:`f` (a categorical
        likelihood's normalisation of the logits); one backward pass of the all-ones
        cotangent gives every :math:`\partial r_{i,e_k} / \partial s_k`. For
        :class:`~pyro_bdl.models.ChoiceTexts` with :math:`C` choices that is one pass
        where :math:`C` would be needed, each through every choice's sequences.
        """
        returned = self._returned
        if returned is self.output:
            weights = columns
        else:
            try:
                (weights,) = torch.autograd.grad(
                    self.output, returned, columns, retain_graph=True, is_grads_batched=True
                )
            except RuntimeError:  # no batching rule: a pass per column, from f back to r only
                pulled = [
                    torch.autograd.grad(self.output, returned, c, retain_graph=True)
                    for c in columns
                ]
                weights = torch.stack([grad for (grad,) in pulled])
        grads = torch.autograd.grad(
            returned,
            [call.output for call in calls],
            torch.ones_like(returned),
            retain_graph=keep_graph,
            allow_unused=True,
        )
        weights = weights.reshape(len(columns), self.batch_size, -1)
        per_call = []
        for call, grad, entry in zip(calls, grads, entries):
            if grad is None:
                per_call.append(columns.new_zeros(len(columns), *call.output.shape))
                continue
            weight = weights[:, :, entry].reshape(*weights.shape[:2], *(1,) * (grad.dim() - 1))
            per_call.append(weight * grad)
        return per_call

    def _factored_sites(self) -> set[str]:
        """Sites whose every recorded use is a ``linear``/``embedding`` call over the batch."""
        jacobians = self._jacobians
        candidates: dict[str, bool] = {}
        for call in self._calls:
            usable = (
                call.kind != "other"
                and call.inputs.shape[0] == self.batch_size
                and call.output._version == call.version
            )
            for site in (call.weight_site, call.bias_site):
                if site is not None:
                    candidates[site] = candidates.get(site, True) and usable
        return {
            site
            for site, usable in candidates.items()
            if usable and jacobians.factored_verified.get(site, True)
        }

    def _factored(self, sites, calls, output_grads) -> dict[str, SiteGradient]:
        batch = self.batch_size
        inputs: dict[str, list] = {}
        grads: dict[str, list] = {}
        kinds: dict[str, set] = {}
        for call, b in zip(calls, output_grads):
            if call.kind == "conv":  # (m, B, C_out, *positions) -> positions before channels
                b = b.flatten(3).transpose(2, 3)
            b = b.reshape(b.shape[0], batch, -1, b.shape[-1])
            if call.weight_site in sites:
                if call.kind == "linear":
                    weight_inputs = call.inputs.reshape(batch, -1, call.inputs.shape[-1])
                elif call.kind == "conv":
                    weight_inputs = _patches(call.inputs, call.options)
                else:
                    weight_inputs = call.inputs.reshape(batch, -1)
                    padding_idx = call.options["padding_idx"]
                    if padding_idx is not None:  # the padding row gets no gradient
                        b = b * (weight_inputs != padding_idx).unsqueeze(-1).to(b.dtype)
                inputs.setdefault(call.weight_site, []).append(weight_inputs)
                grads.setdefault(call.weight_site, []).append(b)
                kinds.setdefault(call.weight_site, set()).add(call.kind)
            if call.bias_site in sites:
                grads.setdefault(call.bias_site, []).append(b)
                kinds.setdefault(call.bias_site, set()).add("bias")
        result = {}
        for site, parts in grads.items():
            shape = self._jacobians.values[site].shape
            if kinds[site] == {"embedding"}:
                result[site] = EmbeddingGradient(
                    _concatenate(inputs[site], 1), _concatenate(parts, 2), shape[0]
                )
            elif kinds[site] <= {"linear", "conv"}:
                result[site] = LinearGradient(
                    _concatenate(inputs[site], 1), _concatenate(parts, 2), shape
                )
            elif kinds[site] == {"bias"}:
                result[site] = LinearGradient(None, _concatenate(parts, 2))
        return result

    def _dense(self, sites: list[str], columns: torch.Tensor) -> dict[str, SiteGradient]:
        jacobians = self._jacobians
        if not jacobians._vmap_failed:
            try:
                return self._vmapped(sites, columns)
            except Exception as error:  # any failure inside vmap: fall back to the loop
                warnings.warn(
                    f"LaplaceGuide: per-example gradients of {sites[:3]} could not be "
                    f"vectorised with torch.func.vmap ({type(error).__name__}: {error}); "
                    "computing them one example at a time, which is slow",
                    stacklevel=4,
                )
                jacobians._vmap_failed = True
        return self._looped(sites, columns)

    def _by_graph(self, sites, columns, keep_graph) -> dict[str, SiteGradient]:
        """Per-example gradients through this run's graph: one cotangent per column and
        example, the column's entries of that example alone (the rows of the Jacobian of
        the output, whatever the model does with its data)."""
        jacobians = self._jacobians
        num_columns, batch = columns.shape[:2]
        eye = torch.eye(batch, dtype=columns.dtype, device=columns.device)
        one_example = eye.reshape(1, batch, batch, *(1,) * (columns.dim() - 2))
        cotangents = (columns.unsqueeze(1) * one_example).flatten(0, 1)
        leaves = [jacobians.values[s] for s in sites]
        try:
            grads = torch.autograd.grad(
                self.output,
                leaves,
                cotangents,
                retain_graph=True,
                allow_unused=True,
                is_grads_batched=True,
            )
        except RuntimeError:  # no batching rule for some backward: one pass per cotangent
            per_cotangent = [
                torch.autograd.grad(self.output, leaves, c, retain_graph=True, allow_unused=True)
                for c in cotangents
            ]
            grads = [
                torch.stack(
                    [torch.zeros_like(leaf) if g[k] is None else g[k] for g in per_cotangent]
                )
                for k, leaf in enumerate(leaves)
            ]
        result = {}
        for site, leaf, grad in zip(sites, leaves, grads):
            grad = leaf.new_zeros(len(cotangents), *leaf.shape) if grad is None else grad
            result[site] = DenseGradient(grad.reshape(num_columns, batch, *leaf.shape))
        if not keep_graph:  # release the run's graph, as the backward passes do
            self.output = self.output.detach()
        return result

    def _split(self):
        batch = self.batch_size
        return tree_map(lambda x: _is_example_batched(x, batch), (self._args, self._kwargs))

    def _vmapped(self, sites, columns):
        jacobians = self._jacobians
        batched = self._split()
        in_dims = tree_map(lambda b: 0 if b else None, batched)
        values = {s: jacobians.values[s].detach() for s in sites}
        fixed = {s: v.detach() for s, v in jacobians.values.items() if s not in values}

        def one_example(values, args, kwargs, example_columns):
            def output(values):
                one_args, one_kwargs = tree_map(
                    lambda x, b: x.unsqueeze(0) if b else x, (args, kwargs), batched
                )
                out = jacobians.run_output(
                    one_args, one_kwargs, {**fixed, **values}, self._output_kind
                )
                return out.squeeze(0)

            _, vjp = torch.func.vjp(output, values)
            return torch.func.vmap(vjp)(example_columns)[0]

        # Predicting without labels, the observed site draws inside the model; its draw is
        # not the differentiated output, so the same draw for every example is harmless.
        randomness = "same" if self._output_kind == "return" else "error"
        with pyro.validation_enabled(False):
            grads = torch.func.vmap(
                one_example, in_dims=(None, *in_dims, 1), randomness=randomness
            )(values, self._args, self._kwargs, columns)
        return {s: DenseGradient(grads[s].transpose(0, 1)) for s in sites}

    def _looped(self, sites, columns):
        jacobians = self._jacobians
        batched = self._split()
        per_example = []
        for i in range(self.batch_size):
            args, kwargs = tree_map(
                lambda x, b, i=i: x[i : i + 1] if b else x, (self._args, self._kwargs), batched
            )
            leaves = {s: jacobians.values[s].detach().requires_grad_() for s in sites}
            with torch.enable_grad():
                values = {**{s: v.detach() for s, v in jacobians.values.items()}, **leaves}
                out = jacobians.run_output(args, kwargs, values, self._output_kind)
                grads = [
                    torch.autograd.grad(
                        out,
                        list(leaves.values()),
                        columns[c, i : i + 1],
                        retain_graph=True,
                        allow_unused=True,
                    )
                    for c in range(columns.shape[0])
                ]
            per_example.append(
                [
                    torch.stack([torch.zeros_like(leaf) if g is None else g for g in column])
                    for leaf, column in zip(leaves.values(), zip(*grads))
                ]
            )
        return {
            s: DenseGradient(torch.stack([grads[k] for grads in per_example], 1))
            for k, s in enumerate(sites)
        }
