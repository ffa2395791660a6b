r"""BLoB's training recipe: two optimisers and re-weighted KL (Table 4, Appendix B.1).

The reference implementation of BLoB takes one minibatch step in two parts:

1. the mean NLL :math:`\ell = -\frac{1}{B}\sum_{n \in \mathcal{D}_i} \log P(y_n \mid A, B)`
   with one flipout draw of A; AdamW updates the means :math:`M`, the B matrices and
   every other point weight with :math:`\nabla \ell`;
2. the weighted KL :math:`\lambda_i \mathrm{KL}` (eq. 11) at the updated means; plain SGD
   at a separate learning rate updates :math:`M` with :math:`\lambda_i \nabla_M
   \mathrm{KL}` and :math:`G` with :math:`\nabla_G \ell + \lambda_i \nabla_G \mathrm{KL}`.

Both learning rates warm up linearly over ``warmup_ratio`` of the steps and then decay
linearly to zero (:func:`~pyro_bdl.inference.vi.blob_svi.warmup_schedule`; BLoB's Table 3
gives every method of the table this schedule).

How much this weighs the KL: the minibatch ELBO, divided by :math:`N` to put it in the
same units (a mean NLL per example), is :math:`\ell + \mathrm{KL} / N` at every step. Here
step :math:`i` has :math:`\ell + \lambda_i \mathrm{KL}`, with the weights summing to 1
over a cycle of :math:`M = L^*/B` steps (eq. 70-71), so :math:`\lambda_i` is
:math:`B / L^*` on average and the KL weighs, on average,

.. math:: N \bar\lambda = \frac{N B}{L^*}

times the ELBO's: :math:`B` times only when :math:`L^* = N`. With :math:`L^* = 100\,
N^{\pi/\gamma}` and :math:`\gamma = 8` this is :math:`B N^{0.61} / 100` (e.g. 43 for
:math:`N = 10^4`, :math:`B = 16`), as in the reference code. ``kl_weighting="uniform"``
(:math:`\lambda_i = B/N`, :math:`M` the minibatches per epoch) weighs it :math:`B` times.

The step runs the model once with the guide's fused draw of every A (no Pyro trace of
the guide, no distribution object or KL per site), with the KL of all sites in one
expression, optimisers over the guide's two flat tensors, and nothing read back from the
device: the statistics it returns are tensors, read when the caller wants them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import pyro
import torch
from pyro.distributions.util import scale_and_mask
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample
from tqdm.auto import trange

from pyro_bdl import distributed
from pyro_bdl._checks import function, instance, integer, one_of, probability, real
from pyro_bdl.inference.minibatch import Minibatches
from pyro_bdl.inference.vi.kl_weights import (
    blob_kl_cycle,
    exponential_kl_weight,
    uniform_kl_weight,
)
from pyro_bdl.inference.vi.mean_field import MeanFieldGuide

__all__ = ["BLoBSVI", "fit_blob", "warmup_schedule"]

# AdamW's epsilon in the reference implementation.
_ADAM_EPS = 1e-6
_KL_WEIGHTINGS = {"exponential": exponential_kl_weight, "uniform": uniform_kl_weight}
_SCHEDULES = ("linear", "constant")


def warmup_schedule(step: int, num_steps: int, warmup_ratio: float, schedule: str) -> float:
    r"""The learning-rate factor of ``step``: linear warm-up, then linear decay or constant.

    transformers' schedules, step for step: the warm-up lasts
    :math:`\lceil r T \rceil` steps of the :math:`T` = ``num_steps`` (``TrainingArguments.
    get_warmup_steps`` with ``warmup_steps=r``); after it ``"linear"`` is
    ``get_linear_schedule_with_warmup`` (the reference implementation's and Table 3's),
    ``"constant"`` is ``get_constant_schedule_with_warmup`` and ``"cosine"`` is
    ``get_cosine_schedule_with_warmup`` (half a cosine from 1 to 0). They are written out
    here because importing transformers takes seconds, which ``import pyro_bdl`` must not
    (``tests/inference/vi/test_blob_svi.py`` checks them against transformers' own).

    :param int step: the step, from 0.
    :param int num_steps: the length of the run.
    :param float warmup_ratio: fraction of the steps of warm-up.
    :param str schedule: ``"linear"``, ``"constant"`` or ``"cosine"``.
    """
    warmup = math.ceil(num_steps * warmup_ratio)
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        progress = (step - warmup) / max(1, num_steps - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    return max(0.0, (num_steps - step) / max(1, num_steps - warmup))


class BLoBSVI:
    r"""One BLoB training step at a time, with the reference two-optimiser scheme.

    Like :class:`pyro.infer.SVI`, :meth:`step` takes the model's arguments for one
    minibatch. The KL weight of step :math:`t` is :math:`\lambda_t` of
    :func:`~pyro_bdl.inference.vi.kl_weights.exponential_kl_weight` over a cycle of
    :func:`~pyro_bdl.inference.vi.kl_weights.blob_kl_cycle` minibatches, or :math:`1/M`
    with :math:`M` the minibatches per epoch (``kl_weighting="uniform"``).

    A step in parts, for gradient accumulation (the Hugging Face Trainer's
    :class:`~pyro_bdl.hf.BLoBTrainer` takes its steps so): :meth:`accumulate` once per
    microbatch, then :meth:`update`. The microbatches of a step share one draw of the
    weight noise :math:`E`, their NLL gradients are averaged (and across the ranks of a
    ``torchrun`` job), and the KL weight is that of the step's whole batch, so that
    :math:`k` microbatches of :math:`B` take the step of one batch of :math:`kB` (with
    flipout, whose signs are drawn per example, the same step in distribution).
    :meth:`step` is one microbatch and an update.

    With ``max_grad_norm`` the NLL gradient of the means (:math:`M`, the B matrices and
    every point weight, what AdamW steps) is clipped to that norm before the AdamW step,
    as plain LoRA training clips its weights' gradient; :math:`G` and the KL are not.

    **References**

    [1] Y. Wang et al., "BLoB", NeurIPS 2024: Algorithm 1, Appendix B.1, Tables 3 and 4;
        and its reference code (``modelwrappers/blob.py`` of Wang-ML-Lab/bayesian-peft).

    Example::

        guide = BLoBGuide(model, net, prior_std=0.2)
        svi = BLoBSVI(model, guide, num_steps=5000, lr=5e-4, kl_lr=0.002)
        for batch in batches:
            svi.step(batch, num_data)

        for microbatch in microbatches:           # gradient accumulation
            svi.accumulate(microbatch, num_data)
        svi.update()

    :param callable model: a Pyro model with a ``bdl.observe`` likelihood.
    :param MeanFieldGuide guide: a :class:`~pyro_bdl.inference.BLoBGuide` (any
        :class:`~pyro_bdl.inference.MeanFieldGuide` works: the recipe is then BBB's).
    :param int num_steps: the length of the run (for the learning-rate schedule).
    :param float lr: AdamW's learning rate (Table 3: 5e-4 RoBERTa, 1e-4 Llama2).
    :param float kl_lr: SGD's learning rate for the KL (Table 4: 0.002 RoBERTa, 0.01 Llama2).
    :param float weight_decay: AdamW's decoupled weight decay.
    :param float warmup_ratio: fraction of the steps of linear warm-up (Table 3: 0.06).
    :param str kl_weighting: ``"exponential"`` (BLoB) or ``"uniform"`` (:math:`1/M`).
    :param float gamma: :math:`\gamma` of the dataset rescaling (Table 4: 8).
    :param str schedule: ``"linear"`` decay after the warm-up (Table 3) or ``"constant"``
        (see :func:`~pyro_bdl.inference.vi.blob_svi.warmup_schedule`).
    :param float max_grad_norm: clip the means' NLL gradient to this norm (None: no clip).
    :param callable backward: how a microbatch's loss is back-propagated (default
        ``loss.backward()``; the Trainer passes its ``accelerator.backward``, which scales
        fp16 losses).
    """

    layout = "training"  # bdl.save keeps the guide and the optimiser (persistence.py)

    def __init__(
        self,
        model: Callable,
        guide: MeanFieldGuide,
        *,
        num_steps: int,
        lr: float = 5e-4,
        kl_lr: float = 0.002,
        weight_decay: float = 0.0,
        warmup_ratio: float = 0.06,
        kl_weighting: str = "exponential",
        gamma: float = 8.0,
        schedule: str = "linear",
        max_grad_norm: float | None = None,
        backward: Callable[[torch.Tensor], None] | None = None,
    ):
        function("model", model, "a Pyro model (a callable)")
        instance("guide", guide, MeanFieldGuide, "a BLoBGuide or MeanFieldGuide")
        num_steps = integer("num_steps", num_steps, low=1)
        lr = real("lr", lr, non_negative=True)
        kl_lr = real("kl_lr", kl_lr, non_negative=True)
        weight_decay = real("weight_decay", weight_decay, non_negative=True)
        warmup_ratio = probability("warmup_ratio", warmup_ratio, open_high=True)
        one_of("kl_weighting", kl_weighting, _KL_WEIGHTINGS)
        gamma = real("gamma", gamma, positive=True)
        one_of("schedule", schedule, _SCHEDULES)
        if max_grad_norm is not None:
            max_grad_norm = real("max_grad_norm", max_grad_norm, positive=True)
        if backward is not None:
            function("backward", backward, "a callable loss -> None, e.g. accelerator.backward")
        self.model = model
        self.guide = guide
        self.num_steps = num_steps
        self.lr = lr
        self.kl_lr = kl_lr
        self.weight_decay = weight_decay
        self.warmup_ratio = warmup_ratio
        self.kl_weighting = kl_weighting
        self.gamma = gamma
        self.schedule = schedule
        self.max_grad_norm = max_grad_norm
        self.backward = backward or torch.Tensor.backward
        self.step_count = 0
        self.num_data: int | None = None
        self.kl_cycle: int | None = None
        self._batch_size: int | None = None  # examples of a microbatch
        self._optimizers: tuple[torch.optim.Optimizer, torch.optim.Optimizer] | None = None
        self._pending: list[dict] | None = None  # optimiser states loaded before the first step
        self._window: _Window | None = None  # the step being accumulated
        self._grad_tensors: list[torch.Tensor] = []

    def step(self, *args, **kwargs) -> dict[str, torch.Tensor | float]:
        """Take one step on the minibatch that ``args`` and ``kwargs`` hold.

        :return: the step's mean NLL and KL (0-d tensors on the model's device: reading
            them, e.g. with ``float()``, waits for the device), its KL weight and, with
            ``max_grad_norm``, the means' gradient norm before the clip.
        """
        self.accumulate(*args, **kwargs)
        return self.update()

    def accumulate(self, *args, **kwargs) -> torch.Tensor:
        """Add the NLL gradient of one microbatch to the step being accumulated.

        The first microbatch of a step draws the weight noise; the others reuse it.

        :return: the microbatch's mean NLL (a 0-d tensor on the model's device).
        """
        self.guide._ensure_setup(*args, **kwargs)
        if self._window is None:
            self._window = _Window(_NoiseState(self.guide.flat_parameters()[0][0].device))
        window = self._window
        with window.noise.replay():
            draws, _, _ = self.guide.draw()
        # The first step validates the model's distributions (labels in their support,
        # ...); later steps skip the checks, each a device sync.
        with pyro.validation_enabled(self._optimizers is None), _Substitute(draws) as run:
            self.model(*args, **kwargs)
        if self._optimizers is None:
            self._setup(run)
        if window.count == 0:  # the sums of the step's gradients start here
            for param in self._grad_tensors:
                param.grad = torch.zeros_like(param)
        nll = -_log_likelihood(run.observed) / self.num_data
        self.backward(nll)
        window.add(nll.detach(), run.priors)
        return nll.detach()

    def reduce_gradients(self) -> None:
        """Average the accumulated gradients over the step's microbatches and ranks.

        :meth:`update` calls it; a loop that checks the gradients between the last
        microbatch and the update (a loss scaler, for one) calls it first, as
        ``DistributedDataParallel`` averages during the last backward pass.
        """
        window = self._window
        if window is None or window.reduced:
            return
        grads = [param.grad for param in self._grad_tensors]
        window.microbatches = distributed.mean_of_sums_([*grads, window.nll], window.count)
        window.reduced = True

    def update(self, lr: float | None = None, kl_lr: float | None = None) -> dict:
        """Take the step with the microbatches accumulated since the last update.

        :param float lr: AdamW's learning rate for this step (default: ``lr`` times the
            schedule's factor; the Trainer passes its scheduler's).
        :param float kl_lr: SGD's learning rate for this step (likewise).
        :return: as :meth:`step`.
        """
        if self._window is None:
            raise RuntimeError("BLoBSVI.update: call accumulate(...) with a microbatch first")
        self.reduce_gradients()
        window, self._window = self._window, None
        if self.kl_cycle is None:
            self._set_kl_cycle(self._batch_size * window.microbatches)
        likelihood_optimizer, kl_optimizer = self._optimizers
        factor = self._schedule(self.step_count)
        _set_lr(likelihood_optimizer, self.lr * factor if lr is None else lr)
        _set_lr(kl_optimizer, self.kl_lr * factor if kl_lr is None else kl_lr)
        record = {}
        if self.max_grad_norm is not None:
            means = likelihood_optimizer.param_groups[0]["params"]
            record["grad_norm"] = torch.nn.utils.clip_grad_norm_(means, self.max_grad_norm)
        likelihood_optimizer.step()
        # G is not AdamW's: it keeps its NLL gradient for the SGD step below.
        likelihood_optimizer.zero_grad(set_to_none=True)

        kl = self._kl(window.priors)
        kl_weight = _KL_WEIGHTINGS[self.kl_weighting](self.step_count, self.kl_cycle)
        (kl_weight * kl).backward()
        kl_optimizer.step()
        kl_optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return {"nll": window.nll, "kl": kl.detach(), "kl_weight": kl_weight, **record}

    def grad_tensors(self) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` :meth:`accumulate` fills: the means, the point
        weights and :math:`G` (empty before the first microbatch)."""
        return list(self._grad_tensors)

    def _setup(self, run: _Substitute) -> None:
        self.num_data, self._batch_size = _data_sizes(run.observed)
        flat = self.guide.flat_parameters()
        locs = [loc for loc, _ in flat]
        scale_params = [raw for _, raw in flat]
        store = pyro.get_param_store()
        point_weights = [store.get_param(name).unconstrained() for name in run.params]
        likelihood_optimizer = torch.optim.AdamW(
            [*locs, *point_weights],
            lr=self.lr,
            eps=_ADAM_EPS,
            weight_decay=self.weight_decay,
            foreach=True,
        )
        kl_optimizer = torch.optim.SGD([*locs, *scale_params], lr=self.kl_lr, foreach=True)
        self._optimizers = (likelihood_optimizer, kl_optimizer)
        self._grad_tensors = [*locs, *point_weights, *scale_params]
        if self._pending is not None:
            for optimizer, saved in zip(self._optimizers, self._pending):
                optimizer.load_state_dict(saved)
            self._pending = None

    def _set_kl_cycle(self, batch_size: int) -> None:
        # the step's whole batch: every microbatch of every rank
        if self.kl_weighting == "exponential":
            self.kl_cycle = blob_kl_cycle(self.num_data, batch_size, self.gamma)
        else:
            self.kl_cycle = math.ceil(self.num_data / batch_size)

    def state_dict(self) -> dict:
        """The training state to resume step for step: the step count, the KL cycle and
        both optimisers' states.

        The guide holds the variational parameters and the model's point weights (its own
        ``state_dict``); ``bdl.save(svi, directory)`` writes both.
        """
        if self._optimizers is None:
            optimizers = self._pending
        else:
            optimizers = [optimizer.state_dict() for optimizer in self._optimizers]
        return {"step_count": self.step_count, "kl_cycle": self.kl_cycle, "optimizers": optimizers}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict`; before the first step, the optimisers (made
        then) take it when they are made."""
        self.step_count = int(state["step_count"])
        cycle = state.get("kl_cycle")
        self.kl_cycle = None if cycle is None else int(cycle)
        if self._optimizers is None:
            self._pending = state["optimizers"]
            return
        for optimizer, saved in zip(self._optimizers, state["optimizers"]):
            optimizer.load_state_dict(saved)

    def _init_settings(self) -> dict:
        # the constructor's arguments, for bdl.save
        return {
            "num_steps": self.num_steps,
            "lr": self.lr,
            "kl_lr": self.kl_lr,
            "weight_decay": self.weight_decay,
            "warmup_ratio": self.warmup_ratio,
            "kl_weighting": self.kl_weighting,
            "gamma": self.gamma,
            "schedule": self.schedule,
            "max_grad_norm": self.max_grad_norm,
        }

    def _schedule(self, step: int) -> float:
        return warmup_schedule(step, self.num_steps, self.warmup_ratio, self.schedule)

    def _kl(self, priors: dict) -> torch.Tensor:
        try:
            return self.guide.kl(priors)
        except ValueError as error:
            raise ValueError(f"BLoBSVI: {error}; BLoB's eq. 11 needs it") from None


class _NoiseState:
    """The random number generators' state before a step's draw, to draw its noise again.

    The microbatches of an accumulated step share one draw of :math:`E`; each must run
    the guide's draw afresh (its graph is freed by the microbatch's backward pass), so
    each replays the generators from the same state, leaving the process's own alone.
    """

    def __init__(self, device: torch.device):
        self.devices = [device] if device.type == "cuda" else []
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(device) for device in self.devices]
        self.replays = 0

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """The first use draws from the process's generators; later ones from a copy of
        their state then."""
        self.replays += 1
        if self.replays == 1:
            yield
            return
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.cpu)
            for device, state in zip(self.devices, self.cuda):
                torch.cuda.set_rng_state(state, device)
            yield


class _Window:
    """The step being accumulated: its noise, the summed NLL and the model's priors."""

    def __init__(self, noise: _NoiseState):
        self.noise = noise
        self.count = 0
        self.nll: torch.Tensor | None = None
        self.priors: dict = {}
        self.reduced = False
        self.microbatches = 1  # of every rank, once reduced

    def add(self, nll: torch.Tensor, priors: dict) -> None:
        self.count += 1
        self.nll = nll.clone() if self.nll is None else self.nll + nll
        self.priors = priors


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class _Substitute(Messenger):
    """Run a model with given values at its latent sites; keep what a BLoB step needs.

    :ivar list observed: the observed sites (their messages, scale and mask included).
    :ivar dict priors: latent site -> its prior distribution.
    :ivar list params: the names of the ``pyro.param`` sites (point weights).
    """

    def __init__(self, values: dict[str, torch.Tensor]):
        super().__init__()
        self.values = values
        self.observed: list[dict] = []
        self.priors: dict = {}
        self.params: list[str] = []

    def _pyro_sample(self, msg: dict) -> None:
        name = msg["name"]
        if name in self.values and not msg["is_observed"]:
            msg["value"] = self.values[name]
            self.priors[name] = msg["fn"]

    def _pyro_post_sample(self, msg: dict) -> None:
        if msg["is_observed"] and not site_is_subsample(msg):
            self.observed.append(msg)

    def _pyro_param(self, msg: dict) -> None:
        if msg["name"] not in self.params:
            self.params.append(msg["name"])


def fit_blob(
    model: Callable,
    guide: MeanFieldGuide,
    *args,
    num_steps: int,
    lr: float = 5e-4,
    kl_lr: float = 0.002,
    weight_decay: float = 0.0,
    warmup_ratio: float = 0.06,
    kl_weighting: str = "exponential",
    gamma: float = 8.0,
    schedule: str = "linear",
    max_grad_norm: float | None = None,
    progress: bool = True,
    **kwargs,
) -> dict[str, list[float]]:
    """Train a BLoB guide with the reference recipe on minibatches (see :class:`BLoBSVI`).

    DataLoader arguments are replaced by a fresh minibatch at every step.

    Example::

        guide = BLoBGuide(model, net, prior_std=0.2)
        history = fit_blob(model, guide, train_loader, len(train_set), num_steps=5000)

    :param callable model: a Pyro model with a ``bdl.observe`` likelihood.
    :param guide: a :class:`~pyro_bdl.inference.BLoBGuide`.
    :param args: the model's arguments (DataLoaders stand for minibatches).
    :param int num_steps: training steps.
    :param bool progress: show a progress bar.
    :return: per step, the mean NLL (``"nll"``), the KL (``"kl"``) and its weight
        (``"kl_weight"``).

    The other parameters are :class:`BLoBSVI`'s.
    """
    instance("progress", progress, bool, "True or False")
    svi = BLoBSVI(
        model,
        guide,
        num_steps=num_steps,
        lr=lr,
        kl_lr=kl_lr,
        weight_decay=weight_decay,
        warmup_ratio=warmup_ratio,
        kl_weighting=kl_weighting,
        gamma=gamma,
        schedule=schedule,
        max_grad_norm=max_grad_norm,
    )
    batches = Minibatches(args, kwargs)
    records: list[dict] = []
    bar = trange(num_steps, desc="BLoB", disable=not progress, leave=False)
    refresh = max(1, num_steps // 100)  # reading the statistics waits for the device
    for step in bar:
        step_args, step_kwargs = batches.next()
        records.append(svi.step(*step_args, **step_kwargs))
        if progress and (step % refresh == 0 or step == num_steps - 1):
            record = records[-1]
            bar.set_postfix(nll=f"{float(record['nll']):.4g}", kl=f"{float(record['kl']):.4g}")
    history: dict[str, list[float]] = {
        key: torch.stack([record[key] for record in records]).tolist() for key in ("nll", "kl")
    }
    history["kl_weight"] = [record["kl_weight"] for record in records]
    return history


def _log_likelihood(observed: list[dict]) -> torch.Tensor:
    """The minibatch log likelihood, scaled by N / B as ``bdl.observe`` asks."""
    total = 0.0
    for site in observed:
        log_prob = site["fn"].log_prob(site["value"], *site["args"], **site["kwargs"])
        total = total + scale_and_mask(log_prob, site["scale"], site["mask"]).sum()
    if not torch.is_tensor(total):
        raise ValueError(
            "BLoBSVI: the model observes nothing; BLoB trains on a likelihood "
            "(bdl.observe(name, distribution, obs=labels, num_data=N))"
        )
    return total


def _data_sizes(observed: list[dict]) -> tuple[int, int]:
    """The data-set size N and the minibatch size B of the observed plate."""
    for site in observed:
        for frame in site["cond_indep_stack"]:
            if frame.full_size:
                return frame.full_size, frame.size
    raise ValueError(
        "BLoBSVI: found no minibatch plate around the observations; observe the labels with "
        "bdl.observe(name, distribution, obs, num_data=N) so that N and the batch size are known"
    )
