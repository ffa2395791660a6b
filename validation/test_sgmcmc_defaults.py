"""The SGMCMC defaults against NUTS on issue 22's five models (moved from
``tests/inference/sgmcmc/test_adaptation.py``, which keeps the quick checks of warm-up
adaptation): with no step size given, SGLD and SGHMC match NUTS (the MLP on
``make_moons`` in function space, its logits at fixed inputs). 14 runs of 3,500 to
201,000 steps, the longest checks of the SGMCMC kernels: ``make validate`` makes the
``STATED`` six (every model, both kernels) and ``PYRO_BDL_VALIDATE_ALL=1`` all 14.

Tolerances. The issue's: posterior means within 0.2 NUTS standard deviations, standard
deviations within 15 %, coordinate by coordinate. Each run also asserts a bulk ESS of at
least ``MIN_ESS`` = 100 on every compared coordinate, so that 0.2 sd is at least two
Monte Carlo standard errors of a mean (sd / sqrt(ESS)) and 15 % at least two of a
standard deviation (about 1 / sqrt(2 ESS)); the NUTS references' own error is 3 to 10
times smaller (their ESS is in ``tests/inference/sgmcmc/references/*.json``). What is
left is the kernels' bias, which adaptation holds near 5 % of a standard deviation
(``target_excess``, 0.1 of a variance, in the stiffest direction warm-up finds), well
inside both.
"""

import math
import os
import time

import numpy as np
import pytest
import torch

from pyro_bdl.diagnostics import ess_bulk
from pyro_bdl.inference import SGHMC, SGLD, SGNHT
from tests.inference.sgmcmc.reference_models import CASES, sample

# the NUTS references are float64, and tests/pyro_models.py builds in the default dtype
pytestmark = pytest.mark.usefixtures("float64")

KERNELS = {"SGHMC": SGHMC, "SGLD": SGLD, "SGNHT": SGNHT}

MIN_ESS = 100
#: (kernel, model, minibatch) -> (warm-up steps, draws): enough draws for MIN_ESS at seed
#: 0 with a margin, measured on 2 shared CPU cores; the figures per seed are in the
#: closing notes of issue 22. What sets the count (``docs/methods/sgmcmc.rst``, "How many
#: draws"):
#:
#: - The stiffest direction. Warm-up lowers the step until the stiffest direction it finds
#:   (``kernel.stiffness`` times stiffer than the average after the diagonal mass) is at
#:   ``target_excess``: SGLD's step falls by about that ratio, SGHMC's by about its square
#:   root. Seed 0's ratios: breast cancer 2.7 (SGHMC) and 3.9 (SGLD), the regression 3.3
#:   and 2.1, minibatches of breast cancer 2.8 and 2.5, the moons MLP 8 to 10; eight
#:   schools and the Gaussian 1 (no change).
#: - SGLD and correlations: on a Gaussian, SGLD's effective draws per draw along a direction
#:   equal that direction's excess variance, so with the stiffest direction at
#:   ``target_excess`` a direction kappa times less stiff gets about 0.1 / kappa. Bulk ESS
#:   at seed 0: breast cancer 111 of 40,000 draws, the regression 128 of 40,000, the moons
#:   MLP 252 of 100,000 (but 67 of its first 60,000: its ESS grows unevenly, so the
#:   count measured); eight schools 396 of 20,000.
#: - SGHMC on eight schools: log tau's sd has a heavy-tailed estimate (its bulk ESS
#:   does not bound it): over seeds 0-5 with 6,000 draws its ratio to NUTS' spread from
#:   0.85 to 1.15, about 0.1 per seed, so 15 % was 1.5 errors; 18,000 draws make it 2.6.
#: - Minibatches of 64 (breast cancer, N = 569, the same posterior as the full batch, so
#:   the same NUTS reference; the moons MLP, N = 150): the gradient noise makes most of the
#:   excess at the tuned step and the mass grows with it (1 + N / B times the curvature),
#:   so a chain needs about N / (2 B target_excess) steps per independent draw whatever
#:   its step size, some five passes through the data, times the factors above. Bulk ESS
#:   at seed 0: SGHMC 205 of 60,000 (breast cancer) and 142 of 30,000 (moons); SGLD 90 of
#:   120,000 and 223 of 160,000.
#:
#: Not every seed passes: SGHMC's sd on the Gaussian is 1.21 and 1.15 at seeds 2 and 4 at
#: ESS over 1,000, a bias (at d = 2 the step-size iteration, which moves every step on a
#: statistic as noisy as its mean, cools the chain it measures, and the kept step runs at
#: an excess of 0.33).
RUNS = {
    ("SGHMC", "gaussian", None): (500, 3000),
    ("SGHMC", "breast_cancer", None): (1000, 12000),
    ("SGHMC", "regression", None): (1000, 12000),
    ("SGHMC", "eight_schools", None): (1000, 18000),
    ("SGHMC", "breast_cancer", 64): (1000, 60000),
    ("SGHMC", "moons", None): (1000, 20000),
    ("SGHMC", "moons", 64): (1000, 30000),
    ("SGLD", "gaussian", None): (500, 6000),
    ("SGLD", "breast_cancer", None): (1000, 60000),
    ("SGLD", "regression", None): (1000, 50000),
    ("SGLD", "eight_schools", None): (1000, 20000),
    ("SGLD", "breast_cancer", 64): (1000, 200000),
    ("SGLD", "moons", None): (1000, 100000),
    ("SGLD", "moons", 64): (1000, 120000),
}


def _assert_matches_nuts(case, samples) -> dict:
    """Every compared coordinate within the tolerances; the worst figures, for the table."""
    reference = case.reference()
    worst = {"mean_off_sds": 0.0, "sd_ratio_off": 0.0, "min_ess": math.inf}
    for site, values in case.summarise(samples).items():
        mean, sd = values.mean(0), values.std(0)
        nuts_mean = torch.tensor(reference[site]["mean"], dtype=torch.float64)
        nuts_sd = torch.tensor(reference[site]["sd"], dtype=torch.float64)
        ess = ess_bulk(values.numpy()[np.newaxis])
        off = ((mean - nuts_mean).abs() / nuts_sd).max().item()
        ratio = (sd / nuts_sd - 1).abs().max().item()
        worst = {
            "mean_off_sds": max(worst["mean_off_sds"], off),
            "sd_ratio_off": max(worst["sd_ratio_off"], ratio),
            "min_ess": min(worst["min_ess"], float(ess.min())),
        }
        assert ess.min() >= MIN_ESS, (site, ess.min())
        assert ((mean - nuts_mean).abs() < 0.2 * nuts_sd).all(), (site, mean, nuts_mean, nuts_sd)
        assert ((sd / nuts_sd - 1).abs() < 0.15).all(), (site, sd / nuts_sd)
    return worst


#: The runs ``make validate`` makes: every model, each kernel, 78,000 steps in all (about
#: 4 minutes of one core; the other seven, 646,000 steps, about 40 minutes, run with
#: ``PYRO_BDL_VALIDATE_ALL=1``, and posteriordb's suite, ``test_posteriordb.py``, checks
#: the defaults on 23 posteriors no one tuned them to).
STATED = {
    ("SGHMC", "gaussian", None),
    ("SGHMC", "breast_cancer", None),
    ("SGHMC", "regression", None),
    ("SGHMC", "moons", None),
    ("SGLD", "gaussian", None),
    ("SGLD", "eight_schools", None),
}
ALL = os.environ.get("PYRO_BDL_VALIDATE_ALL") == "1"


def _runs():
    for run in RUNS:
        name = f"{run[0]}-{run[1]}" + (f"-minibatch{run[2]}" if run[2] else "")
        steps = sum(RUNS[run])
        skip = pytest.mark.skipif(
            not ALL and run not in STATED,
            reason=f"{steps:,} steps: run with PYRO_BDL_VALIDATE_ALL=1",
        )
        yield pytest.param(*run, id=name, marks=skip)


@pytest.mark.parametrize("kernel_name, model_name, minibatch", list(_runs()))
def test_defaults_match_nuts(kernel_name, model_name, minibatch, report):
    case = CASES[model_name](minibatch) if minibatch else CASES[model_name]()
    warmup_steps, num_samples = RUNS[kernel_name, model_name, minibatch]
    kernel = KERNELS[kernel_name](case.model, **case.kernel_options)  # no step size
    started = time.perf_counter()
    samples = sample(case, kernel, num_samples, warmup_steps)
    worst = _assert_matches_nuts(case, samples)
    report(
        "sgmcmc_defaults_vs_nuts",
        kernel=kernel_name,
        model=model_name,
        minibatch=minibatch or "full",
        draws=num_samples,
        **worst,
        seconds=time.perf_counter() - started,
    )


def test_sgld_stays_in_the_posterior_of_eight_schools_at_another_seed():
    # Issue 33: this model (10 parameters) now gets the dense mass, whose warm-up clips a
    # step's whitened gradient at 10 times its equilibrium rms after the start buffer
    # (pyro_bdl/inference/sgmcmc/dense.py), and the chain below stays in the posterior
    # (with the dense mass and no clip the same jump happened at seed 0). Before:
    # at seed 4 (seeds 0-3 and 5 pass test_defaults_match_nuts), in the second slow window
    # (steps 150-250), with log tau's mass learnt in a window the chain spent in the
    # funnel's neck (0.04, the others about 0.1), a state up the funnel, where log tau's
    # curvature grows as tau^2, makes SGLD's explicit step throw log tau to -256. There its
    # gradient is the prior's +1, and it climbs back at about 0.003 a step: the draws sit
    # 195 NUTS sds off (the kernel warns, R-hat). Neither the step-size statistic nor the
    # mass can foresee a curvature a hundred times the window's; SGHMC's friction-bounded
    # momentum does not jump (seeds 0-5 pass). A working chain's 500 draws (ESS of tens)
    # are within 3 NUTS sds of its mean; this one is not.
    case = CASES["eight_schools"]()
    samples = sample(case, SGLD(case.model, **case.kernel_options), 500, 1000, seed=4)
    reference = case.reference()["tau"]
    offset = (samples["tau"].log().mean() - reference["mean"][0]) / reference["sd"][0]
    assert abs(offset) < 3, offset
