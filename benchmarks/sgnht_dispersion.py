"""Issue 21, item 6: where SGNHT's too narrow draws came from, and whether they still are.

SGNHT was 20-30 % under-dispersed on Pyro's regression tutorial model and on eight
schools, and exact on a 2-d Gaussian. Three explanations: the chain mixes too slowly
(more draws would cure it), the thermostat (it holds the kinetic temperature at T,
which a discretised chain in equilibrium does not have), or the step (the explicit Euler
step of Appendix B.3, whose error grows with step size times curvature). Each row runs
fixed kernels (no warm-up adaptation), the same step size for all, against NUTS (the
references of ``tests/inference/sgmcmc/references``), and prints the ratio of each
coordinate's standard deviation to NUTS's (smallest and median):

* ``old``: SGNHT as it was: position, momentum and thermostat all from the current
  state (explicit Euler), the thermostat driving the kinetic temperature to T;
* ``old, 4x draws``: the same chain four times longer: if the ratios stay, it is not
  mixing;
* ``old, step / 4``: a quarter of the step (four times the steps per draw): if the
  ratios approach 1, the discretisation is at fault;
* ``SGHMC at old's friction``: SGHMC (the step of SGNHT in Ding et al.'s order, with the
  momentum first) with its friction fixed at the old chain's mean thermostat: exact, so
  the injected noise and friction are not at fault;
* ``new``: SGNHT now: Ding et al.'s order (momentum first, position and thermostat with
  the new momentum) and the thermostat's target the discretised free particle's kinetic
  temperature, :math:`T / (1 - \\epsilon\\xi / (2\\sigma^2))`.

Run: ``python benchmarks/sgnht_dispersion.py [--draws 10000] [--step-size 0.1]``
(about ten minutes on two shared CPU cores).
"""

from __future__ import annotations

import argparse
import math
import warnings

import pyro
import torch
from pyro.infer import MCMC
from sgmcmc_overhead import reference_models

from pyro_bdl.inference import SGHMC, SGNHT


class OldSGNHT(SGNHT):
    """SGNHT before issue 21: the explicit Euler step of Appendix B.3, target T."""

    def update(self, theta, grads, step_size):
        m = self.momenta
        kinetic = self.kinetic_energy() / self.dimension
        torch._foreach_add_(theta, m, alpha=step_size / self.mass)
        torch._foreach_mul_(m, 1 - (step_size / self.mass) * self.thermostat)
        torch._foreach_add_(m, grads, alpha=step_size / self.num_data)
        noise = math.sqrt(2 * step_size * self.temperature * self.friction / self.num_data)
        torch._foreach_add_(m, self.standard_normal(), alpha=noise)
        self.thermostat.add_(step_size * (kinetic - self.temperature / self.num_data))


def run(case, kernel, draws: int, warmup: int):
    pyro.set_rng_seed(0)
    mcmc = MCMC(kernel, num_samples=draws, warmup_steps=warmup, disable_progbar=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the verdicts are the point of this script
        mcmc.run(*case.args)
    return case.summarise(mcmc.get_samples()), kernel


def ratios(case, compared) -> tuple[float, float]:
    reference = case.reference()
    values = torch.cat(
        [compared[site].std(0) / torch.tensor(reference[site]["sd"]) for site in compared]
    )
    return float(values.min()), float(values.median())


def main(draws: int, step_size: float, warmup: int) -> None:
    models = reference_models()
    fixed = {"adapt_step_size": False, "adapt_mass_matrix": False}
    print(f"step_size {step_size}, friction 1, mass 1, {draws} draws after {warmup} warm-up")
    print("| model | kernel | sd / NUTS sd (smallest) | (median) | mean thermostat |")
    print("|---|---|---|---|---|")
    for name in ("regression", "eight_schools"):
        case = models.CASES[name]()
        options = {**case.kernel_options, **fixed}
        old_kernel = OldSGNHT(case.model, step_size, **options)
        rows = [("old", *run(case, old_kernel, draws, warmup))]
        thermostat = sum(old_kernel.diagnostics()["sample_stats"]["thermostat"]) / draws
        rows.append(
            (
                "old, 4x draws",
                *run(case, OldSGNHT(case.model, step_size, **options), 4 * draws, warmup),
            )
        )
        quarter = OldSGNHT(case.model, step_size / 4, thin=4, **options)
        rows.append(("old, step / 4", *run(case, quarter, draws, 4 * warmup)))
        at_friction = SGHMC(case.model, step_size, friction=thermostat, **options)
        rows.append(("SGHMC at old's friction", *run(case, at_friction, draws, warmup)))
        rows.append(("new", *run(case, SGNHT(case.model, step_size, **options), draws, warmup)))
        for label, compared, kernel in rows:
            smallest, median = ratios(case, compared)
            stats = kernel.diagnostics()["sample_stats"]
            xi = (
                sum(stats["thermostat"]) / len(stats["thermostat"])
                if "thermostat" in stats
                else None
            )
            shown = "" if xi is None else f"{xi:.3f}"
            print(f"| {name} | {label} | {smallest:.2f} | {median:.2f} | {shown} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=10_000)
    parser.add_argument("--step-size", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=2000)
    arguments = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    main(arguments.draws, arguments.step_size, arguments.warmup)
