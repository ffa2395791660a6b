r"""Telling a diverging chain from a noisy one, and warm-up's recovery from a divergence.

A chain diverges when a step is beyond the stability limit of some direction: that
direction's amplitude then grows by a factor each step, and with it the momenta's
kinetic energy and the potential energy. The step-size adaptation does not see it
coming: its statistic is averaged over all directions, so on a network one direction's
growth shows only when its energy is a sizeable share of the whole (on the 1M-weight
MLP of ``benchmarks/sgmcmc_overhead.py`` the excess stayed within 0.04 of 0 while the
step grew 3 % a step, then read 66 and, a step later, 995, with the potential from 56
to 140,000 and 4.8 million).

**The rule** (:class:`Sentinel`). A read of the chain's statistic (the excess of the
kinetic temperature, see :mod:`~pyro_bdl.inference.sgmcmc.adaptation`: each warm-up
step's, and each kept draw's after warm-up) *is out of bounds* when its excess over
``target_excess`` is more than ``DIVERGED`` (20) times the larger of ``target_excess``
and the running root mean square of the excess's earlier deviations from
``target_excess``, *and* the potential energy is above every one of the last
``HISTORY`` (20) potentials; two reads in a row out of bounds are a divergence. A
non-finite potential, statistic or parameter is one at once (when the model and data
are finite at the chain's start on that batch, see
:mod:`~pyro_bdl.inference.sgmcmc.divergence`).

Why it is sound with minibatch noise, which heats a chain and makes its statistic
noisy:

* the threshold is relative to the spread the chain's own statistic showed before (out
  of bounds reads are not counted into it, so a divergence cannot raise its own bar),
  and at least 20 times the target: a chain heated by its minibatches, or by the energy
  it releases on its way in, has its heat in that spread. For a Gaussian target the
  kinetic temperature is a chi-square variable over the number of parameters; even for
  one parameter, a value 20 standard deviations above its mean has probability below
  1e-7;
* a noisy minibatch can kick the momenta once, but it cannot make the potential reach
  a new high at the next step too, which the second read needs (the next batch is an
  ordinary one). In equilibrium a high kinetic energy goes with a low potential (the
  chain crosses the mode fast); only a divergence raises both, step after step;
* on its way in from a far start a chain is heated by the energy it releases while its
  potential falls: not a new high.

A divergence slower than the spread's memory (about 20 reads) raises the spread with
it and is left to the non-finite check and to the step-size adaptation, which shrinks
the step while the statistic is above its target.

**Recovery in warm-up** (:class:`Recovery`), whose draws are discarded anyway: every
``SNAPSHOT_EVERY`` (10) warm-up steps, and at the first, the chain's position and its
adaptation's state (:meth:`~pyro_bdl.inference.sgmcmc.adaptation.Adaptation.state`, as
a checkpoint holds it) are copied. A divergence sets both back to that copy, draws the
momenta afresh and halves the step size that diverged, which becomes the largest the
adaptation may take from then on (``Adaptation.recover``); the statistics the diverging
steps fed the adaptation (the window's gradients and the step size's running spread) are
gone with the restored state. The copy costs one more of the adaptation's buffers and
of the parameters during warm-up, and one copy of them per ten steps. More than
``MAX_RECOVERIES`` (4) recoveries stop the chain with a
:class:`~pyro_bdl.inference.sgmcmc.divergence.DivergenceError` naming the step size that
would start it below the step that diverged. After warm-up a divergence is never
recovered from: it stops the chain.
"""

from __future__ import annotations

import copy
import math

import torch

__all__ = ["CALM", "DIVERGED", "MAX_RECOVERIES", "Recovery", "Sentinel"]

#: A read is out of bounds when its excess over the target is this many times the larger
#: of the target and the statistic's spread before (and the potential is at a new high).
DIVERGED = 20.0
#: Energies remembered (of reads in bounds); half as many arm the sentinel.
HISTORY = 20
#: A read within this many spreads above the statistic's mean is calm: it counts into the
#: spread as it is (one beyond, as if at this edge), and a copy of the chain's state
#: needs ``SNAPSHOT_EVERY`` calm reads in a row.
CALM = 3.0
#: Warm-up steps between the copies of the chain's state that a recovery restores.
SNAPSHOT_EVERY = 10
#: Recoveries allowed in a warm-up; one more stops the chain.
MAX_RECOVERIES = 4
#: Least weight of the newest read in the statistic's running mean and variance.
_SPREAD_WEIGHT = 0.05


class Sentinel:
    """Judges each read of a chain's statistic and energy (see the module docstring).

    :param float target: ``target_excess``, the statistic's level in equilibrium.
    """

    def __init__(self, target: float):
        self.target = target
        self._mean = 0.0  # running mean of the statistic
        self._variance = 0.0  # and its running variance
        self._count = 0
        self._energies: list[float] = []  # of the last reads in bounds
        self._out = 0  # out-of-bounds reads in a row
        #: Calm reads in a row, judged (see ``CALM``).
        self.calm = 0

    @property
    def armed(self) -> bool:
        """Whether enough energies were seen to tell one that rose."""
        return len(self._energies) >= HISTORY // 2

    def diverged(self, statistic: float, energy: float) -> bool:
        """Take a read of the statistic and the energy (both finite); return whether it
        completes a divergence (two reads in a row out of bounds)."""
        spread = max(self.target, math.sqrt(self._variance))
        deviation = statistic - self._mean
        if self.armed and deviation > DIVERGED * spread:
            top, bottom = max(self._energies), min(self._energies)
            rose = energy > top + (top - bottom)
            self._out = self._out + 1 if rose else 0
            self.calm = 0
            return self._out >= 2
        self._out = 0
        calm = deviation <= CALM * spread
        self.calm = self.calm + 1 if calm and self.armed else 0
        self._energies.append(energy)
        del self._energies[:-HISTORY]
        # a read above the calm band counts as if at its edge: a divergence that grows
        # step by step would otherwise raise its own bar as fast as it grows
        deviation = min(deviation, CALM * spread)
        self._count += 1
        weight = max(1.0 / self._count, _SPREAD_WEIGHT)
        self._mean += weight * deviation
        self._variance = (1 - weight) * (self._variance + weight * deviation**2)
        return False

    def forget_energies(self) -> None:
        """Forget the energies seen (they are not comparable with those to come)."""
        self._energies.clear()
        self._out = self.calm = 0

    def state(self) -> dict:
        """The sentinel's memory (numbers), for :meth:`load_state`."""
        return {
            "moments": (self._mean, self._variance, self._count),
            "energies": list(self._energies),
        }

    def load_state(self, numbers: dict) -> None:
        """Set the memory back to a :meth:`state`."""
        self._mean, self._variance, self._count = numbers["moments"]
        self._energies = list(numbers["energies"])
        self._out = self.calm = 0


class Recovery:
    """Warm-up's copy of a chain's last sane state and the recoveries made from it.

    Besides the chain's start, a copy is taken only when the sentinel has judged the
    reads since the last one and found them in bounds: a chain that diverges before it
    can be judged (a step size far too large from the start) is set back to where it
    started.

    :param state: the chain's :class:`~pyro_bdl.inference.sgmcmc.state.ChainState`,
        whose ``adaptation`` adapts the step size.
    :param Sentinel sentinel: the chain's judge, whose memory is set back too.
    """

    def __init__(self, state, sentinel: Sentinel):
        self._state = state
        self._sentinel = sentinel
        self._theta: list[torch.Tensor] | None = None
        self._saved: tuple[dict[str, torch.Tensor], dict, dict] | None = None
        #: The steps at which warm-up diverged and was set back.
        self.steps: list[int] = []

    def save(self, step: int) -> None:
        """Copy the chain's state if ``step`` (the warm-up step about to be taken) is due."""
        sane = self._sentinel.calm >= SNAPSHOT_EVERY  # every read since the last copy
        if self._theta is not None and (step % SNAPSHOT_EVERY or not sane):
            return
        state = self._state
        with torch.no_grad():
            if self._theta is None:
                self._theta = [t.detach().clone() for t in state.theta]
            else:
                torch._foreach_copy_(self._theta, state.theta)
        tensors, numbers = state.adaptation.state()
        tensors = {key: t.detach().clone() for key, t in tensors.items()}
        self._saved = (tensors, copy.deepcopy(numbers), self._sentinel.state())

    def restore(self, step: int) -> bool:
        """Set the chain back to its copy with half the step size that diverged at
        ``step``; return False, changing nothing, when recoveries are spent."""
        if len(self.steps) >= MAX_RECOVERIES:
            return False
        self.steps.append(step)
        state, adaptation = self._state, self._state.adaptation
        diverged = adaptation.step_size
        with torch.no_grad():
            torch._foreach_copy_(state.theta, self._theta)
        tensors, numbers, sentinel = self._saved
        adaptation.load_state(tensors, copy.deepcopy(numbers))
        adaptation.recover(diverged)
        self._sentinel.load_state(sentinel)
        return True

    def advice(self, step: int) -> str:
        """What to do when recoveries are spent (warm-up diverged again at ``step``): a
        step size below the one that diverged."""
        adaptation = self._state.adaptation
        steps = ", ".join(str(s) for s in [*self.steps, step])
        return (
            f"warm-up diverged at steps {steps} and was set back each time with half the "
            f"step size, which diverged again at {adaptation.step_size:.3g} (in the adapted "
            f"mass's units); pass step_size={adaptation.unit_step_size() / 2:.3g} or smaller "
            "(a step for the unit mass, where adaptation starts), or put the model's "
            "parameters and data on a scale of about one"
        )
