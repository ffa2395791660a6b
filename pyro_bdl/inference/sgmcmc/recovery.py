r"""Telling a diverging chain from a noisy one, and warm-up's recovery from a divergence.

A chain diverges when a step is beyond the stability limit of some direction: that
direction's amplitude then grows by a factor each step, and with it the momenta's
kinetic energy and the potential energy. The step-size adaptation does not see it
coming: its statistic is averaged over all directions, so on a network one direction's
growth shows only when its energy is a sizeable share of the whole (on the 1M-weight
MLP of ``benchmarks/sgmcmc_overhead.py`` the excess stayed within 0.04 of 0 while the
step grew 3 % a step, then read 66 and, a step later, 995).

**The rule** (:class:`Sentinel`). Each read of the chain's statistic, the excess of its
kinetic temperature (see :mod:`~pyro_bdl.inference.sgmcmc.adaptation`; each warm-up
step's, and after warm-up each kept draw's), comes with the chain's energy, the
potential plus the kinetic energy that the statistic reads. A read is *out of bounds*
when the statistic is more than ``DIVERGED`` (20) spreads above its running mean, the
spread being the larger of ``target_excess`` and the statistic's running standard
deviation; and the energy *rose* when it is above the highest of the last ``HISTORY``
(20) reads in bounds by more than their range. Two reads in a row out of bounds, each
with a risen energy, are a divergence. A non-finite potential or parameter is one at
once, when the data, the model and its gradient are finite at the chain's start on that
batch (:mod:`~pyro_bdl.inference.sgmcmc.divergence`).

Why it is sound with minibatch noise, which heats a chain and makes its statistic noisy:

* the bar is the spread the statistic showed before, in calm reads, so the heat of the
  minibatches is in it. For a Gaussian target the kinetic temperature is a chi-square
  variable over the number of parameters; for one parameter, the noisiest, the bar
  alone is passed by 2e-4 of independent reads and 2e-3 of reads as correlated as
  SGHMC's (simulated, 200,000 reads each), and never twice in a row with a risen energy.
  Only calm reads (within ``CALM``, 3, spreads) count into the spread, and a read above
  moves the mean as if at that edge, so that a divergence that grows step by step (the
  MLP's, at half the step, over twenty steps) cannot raise the bar as fast as it grows;
* a noisy minibatch can kick the momenta once, but the energy rises only when the
  kinetic energy gained is not paid for by the potential, and stays up at the next read
  only when the kick more than doubled the kinetic energy of every parameter together;
* on its way in from a far start a chain is heated by the energy it releases while its
  potential falls: its energy does not rise.

**Recovery in warm-up** (:class:`Recovery`), whose draws are discarded anyway: at the
chain's second step (its first sets the first step size), and every ``SNAPSHOT_EVERY``
(25) steps after ``SNAPSHOT_EVERY`` calm reads in a row (within ``CALM`` spreads of the
mean), the chain's position and its adaptation's state
(:meth:`~pyro_bdl.inference.sgmcmc.adaptation.Adaptation.state`, as a checkpoint holds
it) are copied. A divergence sets both back to that copy, draws the momenta afresh, and
halves the step size that diverged, which becomes the largest the adaptation may take
from then on (``Adaptation.recover``): the statistic averaged over directions did not see
the divergence coming, and would grow the step back to it. What the diverging steps fed
the adaptation (the window's gradients, the step size's running spread) and the sentinel
goes with the state set back. The copy holds the adaptation's buffers and the parameters
once more during warm-up (on the MLP, 8.5 times its parameters), and costs a pass over
them per 25 steps. More than ``MAX_RECOVERIES`` (4) recoveries in a row, without a new
copy between them, stop the chain with a
:class:`~pyro_bdl.inference.sgmcmc.divergence.DivergenceError` that names the step size
to start from. After warm-up a divergence is never recovered from: it stops the chain,
with the draws kept before it.
"""

from __future__ import annotations

import copy
import math

import torch

__all__ = ["CALM", "DIVERGED", "MAX_RECOVERIES", "Recovery", "Sentinel"]

#: A read is out of bounds when the statistic is this many spreads above its running mean
#: (the spread: the larger of the target and the statistic's running standard deviation).
DIVERGED = 20.0
#: Energies remembered (of reads in bounds); half as many arm the sentinel.
HISTORY = 20
#: A read within this many spreads above the statistic's mean is calm: it counts into the
#: spread as it is (one beyond, as if at this edge), and a copy of the chain's state
#: needs ``SNAPSHOT_EVERY`` calm reads in a row.
CALM = 3.0
#: Warm-up steps between the copies of the chain's state that a recovery restores (a
#: copy of the 1M-weight MLP's parameters and adaptation costs 2 ms, a step 12 ms).
SNAPSHOT_EVERY = 25
#: Recoveries allowed in a row (without a new copy of the chain's state between them, so
#: without the chain calm for ``SNAPSHOT_EVERY`` steps); one more stops the chain.
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
        # Only calm reads count into the spread, and a read above the calm band moves the
        # mean as if at its edge: a divergence that grows step by step would otherwise
        # raise its own bar as fast as it grows (the 1M MLP's did, 17 % a read).
        self._count += 1
        weight = max(1.0 / self._count, _SPREAD_WEIGHT)
        if calm:
            self._variance = (1 - weight) * (self._variance + weight * deviation**2)
        self._mean += weight * min(deviation, CALM * spread)
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
    reads since the last one and found them calm: a chain that diverges before it can be
    judged (a step size far too large from the start) is set back to where it started.

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
        self._streak = 0  # recoveries since the chain last made a copy

    def save(self, step: int) -> None:
        """Copy the chain's state if ``step`` (the warm-up step about to be taken) is due."""
        state = self._state
        if state.adaptation.step_size is None:
            return  # not begun: the chain's first step sets its first step size (and metric)
        sane = self._sentinel.calm >= SNAPSHOT_EVERY  # every read since the last copy
        if self._theta is not None and (step % SNAPSHOT_EVERY or not sane):
            return
        with torch.no_grad():
            if self._theta is None:
                self._theta = [t.detach().clone() for t in state.theta]
            else:
                torch._foreach_copy_(self._theta, state.theta)
        tensors, numbers = state.adaptation.state()
        copies = None if self._saved is None else self._saved[0]
        if copies is not None and copies.keys() == tensors.keys():
            torch._foreach_copy_(list(copies.values()), list(tensors.values()))
        else:  # the first copy, or the dense metric made since the last
            copies = {key: t.detach().clone() for key, t in tensors.items()}
        self._saved = (copies, copy.deepcopy(numbers), self._sentinel.state())
        self._streak = 0

    def restore(self, step: int) -> bool:
        """Set the chain back to its copy with half the step size that diverged at
        ``step``; return False, changing nothing, when ``MAX_RECOVERIES`` were made since
        the chain last went calm long enough for a new copy."""
        if self._streak >= MAX_RECOVERIES:
            return False
        self._streak += 1
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
