"""The ported posteriors: posteriordb's name -> its Pyro model, data and priors.

Each :class:`Posterior` names its posteriordb data set (``data/<data_name>.json``, as
posteriordb ships it) and builds, from that data, Stan's transformed data as a tuple of
tensors whose first dimension indexes the observations, and the model
(:mod:`.models`) with its constants. ``wide_priors`` names the sites whose flat Stan prior
became a wide proper one, with its scale (a power of ten at least 100 times every reference
``|mean| + sd`` of the site).

Example::

    posterior = POSTERIORS["kidiq-kidscore_momiq"]
    model, data = posterior.build()          # model(data, num_data)
    MCMC(NUTS(model), ...).run(data, posterior.num_data(data))
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyro.distributions as dist
import torch
from pyro.infer import Predictive

from validation.posteriordb import models

__all__ = ["DATA", "POSTERIORS", "Posterior", "stan_draws", "stan_index"]

#: The posteriordb data sets, one JSON file each.
DATA = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class Posterior:
    """One posteriordb posterior as ported.

    :param str name: posteriordb's name, ``<data>-<model>``.
    :param str data_name: posteriordb's data set name (``data/<data_name>.json``).
    :param callable make: ``raw data dict -> (model, data tuple)``.
    :param bool exchangeable: whether the likelihood is a sum over the first dimension of
        the data, so that minibatches of it are unbiased.
    :param dict wide_priors: site -> scale of the wide proper prior that replaces Stan's
        flat one.
    """

    name: str
    data_name: str
    make: Callable[[dict], tuple[Callable, tuple]]
    exchangeable: bool = False
    wide_priors: dict[str, float] = field(default_factory=dict)

    def raw_data(self) -> dict:
        """posteriordb's data, as shipped."""
        return json.loads((DATA / f"{self.data_name}.json").read_text())

    def build(self, dtype: torch.dtype = torch.float64) -> tuple[Callable, tuple]:
        """The model and its data (a tuple of tensors of ``dtype``)."""
        model, data = self.make(self.raw_data())
        return model, tuple(torch.as_tensor(x, dtype=dtype) for x in data)

    @staticmethod
    def num_data(data: tuple) -> int:
        """N, the length of the data's first dimension."""
        return len(data[0])


def stan_index(name: str) -> tuple[str, tuple[int, ...]]:
    """Stan's ``beta[1]`` as the Pyro site ``beta`` and index ``(0,)`` (sites are named
    and shaped as Stan's parameters)."""
    match = re.fullmatch(r"(\w+)(?:\[([\d,\s]+)\])?", name)
    if match is None:
        raise ValueError(f"not a Stan parameter name: {name!r}")
    site, index = match.groups()
    return site, tuple(int(i) - 1 for i in index.split(",")) if index else ()


def _columns(*columns) -> torch.Tensor:
    """The design matrix: a column of ones, then ``columns``."""
    columns = [torch.as_tensor(c, dtype=torch.float64) for c in columns]
    return torch.stack([torch.ones_like(columns[0]), *columns], -1)


def _regression(
    name: str, data_name: str, design: Callable, beta: float, sigma, flat_beta: bool = True
) -> Posterior:
    """A linear regression (:func:`~validation.posteriordb.models.linear_regression`) with
    design ``design(raw) -> (X, y)``.

    :param float beta: the scale of beta's normal prior: a wide one that replaces Stan's
        flat prior, unless ``flat_beta`` is False (Stan's own prior).
    :param sigma: a scale (Stan's prior is flat: a wide HalfNormal) or a function returning
        Stan's prior.
    """
    flat_sigma = isinstance(sigma, float)
    wide = {"beta": beta} if flat_beta else {}
    if flat_sigma:
        wide["sigma"] = sigma

    def make(raw):
        # The prior is made with the model, in the dtype the caller has chosen by then: one
        # made at import is float32, and so were sigma's draws in a float64 run.
        sigma_prior = dist.HalfNormal(sigma) if flat_sigma else sigma()
        model = functools.partial(
            models.linear_regression, beta_scale=beta, sigma_prior=sigma_prior
        )
        return model, design(raw)

    return Posterior(name, data_name, make, exchangeable=True, wide_priors=wide)


def _half_normal_10() -> dist.Distribution:
    return dist.HalfNormal(10.0)


def _half_cauchy_2_5() -> dist.Distribution:
    return dist.HalfCauchy(2.5)


def _tensors(raw: dict, *names) -> list[torch.Tensor]:
    return [torch.as_tensor(raw[name], dtype=torch.float64) for name in names]


def _sd(x: torch.Tensor) -> torch.Tensor:
    return x.std(unbiased=True)  # Stan's sd() divides by N - 1


# -- the designs: Stan's transformed data, (X, y) -----------------------------------------


def _kidiq(raw, terms: str):
    score, hs, iq = _tensors(raw, "kid_score", "mom_hs", "mom_iq")
    if terms == "c":  # centred
        hs, iq = hs - hs.mean(), iq - iq.mean()
    elif terms == "c2":  # centred on reference points
        hs, iq = hs - 0.5, iq - 100
    elif terms == "z":  # standardised by two sds
        hs, iq = (hs - hs.mean()) / (2 * _sd(hs)), (iq - iq.mean()) / (2 * _sd(iq))
    chosen = {
        "momhs": [hs],
        "momiq": [iq],
        "momhsiq": [hs, iq],
    }.get(terms, [hs, iq, hs * iq])
    return _columns(*chosen), score


def _mom_work(raw):
    (score,) = _tensors(raw, "kid_score")
    work = torch.as_tensor(raw["mom_work"])
    return _columns(*(work == level for level in (2, 3, 4))), score


def _earnings(raw, response: str, terms: str):
    earn, height, male = _tensors(raw, "earn", "height", "male")
    y = {"earn": earn, "log": earn.log(), "log10": earn.log10()}[response]
    z_height = (height - height.mean()) / _sd(height)
    chosen = {
        "height": [height],
        "height_male": [height, male],
        "interaction": [height, male, height * male],
        "interaction_z": [z_height, male, z_height * male],
        "logheight_male": [height.log(), male],
    }[terms]
    return _columns(*chosen), y


def _mesquite(raw, terms: str):
    weight, d1, d2, canopy, total, density, group = _tensors(
        raw, "weight", "diam1", "diam2", "canopy_height", "total_height", "density", "group"
    )
    volume, area, shape = (d1 * d2 * canopy).log(), (d1 * d2).log(), (d1 / d2).log()
    chosen = {
        "raw": [d1, d2, canopy, total, density, group],
        "log": [d1.log(), d2.log(), canopy.log(), total.log(), density.log(), group],
        "logvolume": [volume],
        "logva": [volume, area, group],
        "logvas": [volume, area, shape, total.log(), density.log(), group],
        "logvash": [volume, area, shape, total.log(), group],
    }[terms]
    return _columns(*chosen), weight if terms == "raw" else weight.log()


def _nes(raw):
    party, ideo, race, educ, gender, income = _tensors(
        raw, "partyid7", "real_ideo", "race_adj", "educ1", "gender", "income"
    )
    age = torch.as_tensor(raw["age_discrete"])
    ages = [age == level for level in (2, 3, 4)]
    return _columns(ideo, race, *ages, educ, gender, income), party


def _blr(raw):
    return _tensors(raw, "X", "y")


# -- the other models ---------------------------------------------------------------------


def _kilpisjarvi(raw):
    model = functools.partial(
        models.kilpisjarvi,
        alpha_prior=(raw["pmualpha"], raw["psalpha"]),
        beta_prior=(raw["pmubeta"], raw["psbeta"]),
        sigma_scale=1e3,
    )
    return model, _tensors(raw, "x", "y")


def _eight_schools(raw):
    return models.eight_schools_noncentered, _tensors(raw, "y", "sigma")


def _arK(raw):
    return functools.partial(models.arK, order=raw["K"]), _tensors(raw, "y")


def _arma(raw):
    return models.arma11, _tensors(raw, "y")


def _garch(raw):
    return models.garch11, _tensors(raw, "y", "sigma1")


def _gp_pois(raw):
    return models.gp_pois_regr, _tensors(raw, "x", "k")


def _gp(raw):
    return models.gp_regr, _tensors(raw, "x", "y")


def _gauss_mix(raw):
    return models.low_dim_gauss_mix, _tensors(raw, "y")


def _one_comp(raw):
    if raw["t0"] != 0:
        raise ValueError(f"one_comp_mm_elim_abs: the port starts at t0 = 0, got {raw['t0']}")
    model = functools.partial(models.one_comp_mm_elim_abs, dose=raw["D"], volume=raw["V"])
    return model, _tensors(raw, "times", "C_hat")


def _hmm(raw):
    return models.hmm_example, _tensors(raw, "y")


def _hmm_drive(raw, normal: bool):
    model = functools.partial(
        models.hmm_drive,
        transition_prior=raw["alpha"],
        emission_sd=(raw["tau"], raw["rho"]) if normal else None,
    )
    return model, _tensors(raw, "u", "v")


def _registry() -> dict[str, Posterior]:
    posteriors = [
        Posterior("eight_schools-eight_schools_noncentered", "eight_schools", _eight_schools),
        Posterior("arK-arK", "arK", _arK),
        Posterior("arma-arma11", "arma", _arma),
        Posterior("garch-garch11", "garch", _garch, wide_priors={"mu": 1e3, "alpha0": 1e3}),
        Posterior("gp_pois_regr-gp_pois_regr", "gp_pois_regr", _gp_pois),
        Posterior("gp_pois_regr-gp_regr", "gp_pois_regr", _gp),
        Posterior("low_dim_gauss_mix-low_dim_gauss_mix", "low_dim_gauss_mix", _gauss_mix, True),
        Posterior("one_comp_mm_elim_abs-one_comp_mm_elim_abs", "one_comp_mm_elim_abs", _one_comp),
        Posterior("hmm_example-hmm_example", "hmm_example", _hmm),
        Posterior(
            "bball_drive_event_0-hmm_drive_0",
            "bball_drive_event_0",
            functools.partial(_hmm_drive, normal=False),
        ),
        Posterior(
            "bball_drive_event_1-hmm_drive_1",
            "bball_drive_event_1",
            functools.partial(_hmm_drive, normal=True),
        ),
        Posterior(
            "kilpisjarvi_mod-kilpisjarvi",
            "kilpisjarvi_mod",
            _kilpisjarvi,
            True,
            wide_priors={"sigma": 1e3},
        ),
        _regression("sblrc-blr", "sblrc", _blr, 10.0, _half_normal_10, flat_beta=False),
        _regression("sblri-blr", "sblri", _blr, 10.0, _half_normal_10, flat_beta=False),
    ]
    for terms in ("momhs", "momiq", "momhsiq", "interaction"):
        design = functools.partial(_kidiq, terms=terms)
        posteriors.append(
            _regression(f"kidiq-kidscore_{terms}", "kidiq", design, 1e4, _half_cauchy_2_5)
        )
    designs = {
        f"interaction_{terms}": functools.partial(_kidiq, terms=terms) for terms in ("c", "c2", "z")
    }
    for name, design in {**designs, "mom_work": _mom_work}.items():
        posteriors.append(
            _regression(
                f"kidiq_with_mom_work-kidscore_{name}", "kidiq_with_mom_work", design, 1e4, 1e4
            )
        )
    earnings = {
        "earn_height": ("earn", "height", 1e7, 1e7),
        "log10earn_height": ("log10", "height", 1e3, 1e2),
        "logearn_height": ("log", "height", 1e3, 1e2),
        "logearn_height_male": ("log", "height_male", 1e3, 1e2),
        "logearn_interaction": ("log", "interaction", 1e3, 1e2),
        "logearn_interaction_z": ("log", "interaction_z", 1e3, 1e2),
        "logearn_logheight_male": ("log", "logheight_male", 1e3, 1e2),
    }
    for name, (response, terms, beta, sigma) in earnings.items():
        design = functools.partial(_earnings, response=response, terms=terms)
        posteriors.append(_regression(f"earnings-{name}", "earnings", design, beta, sigma))
    mesquite = {
        "mesquite": ("raw", 1e5, 1e5),
        "logmesquite": ("log", 1e3, 1e2),
        "logmesquite_logvolume": ("logvolume", 1e3, 1e2),
        "logmesquite_logva": ("logva", 1e3, 1e2),
        "logmesquite_logvas": ("logvas", 1e3, 1e2),
        "logmesquite_logvash": ("logvash", 1e3, 1e2),
    }
    for name, (terms, beta, sigma) in mesquite.items():
        design = functools.partial(_mesquite, terms=terms)
        posteriors.append(_regression(f"mesquite-{name}", "mesquite", design, beta, sigma))
    for year in range(1972, 2001, 4):
        posteriors.append(_regression(f"nes{year}-nes", f"nes{year}", _nes, 1e3, 1e3))
    return {posterior.name: posterior for posterior in posteriors}


#: Every ported posterior, by posteriordb name.
POSTERIORS: dict[str, Posterior] = _registry()


def stan_draws(
    posterior: Posterior, samples: dict[str, torch.Tensor], model, data: tuple, names
) -> dict[str, np.ndarray]:
    """The draws of Stan's parameters ``names``, each shaped ``(chain, draw)``.

    :param dict samples: latent site -> draws shaped ``(chain, draw, *site shape)`` (what
        ``MCMC.get_samples(group_by_chain=True)`` returns).
    :param model: the posterior's model, whose ``pyro.deterministic`` sites (Stan's
        transformed parameters) are computed from ``samples`` on ``data`` by ``Predictive``.
    """
    located = {name: stan_index(name) for name in names}
    derived = sorted({site for site, _ in located.values() if site not in samples})
    if derived:
        chains, draws = next(iter(samples.values())).shape[:2]
        flat = {site: value.flatten(0, 1) for site, value in samples.items()}
        predictive = Predictive(model, posterior_samples=flat, return_sites=derived)
        with torch.no_grad():
            computed = predictive(data, posterior.num_data(data))
        samples = dict(samples)
        for site in derived:
            samples[site] = computed[site].reshape(chains, draws, -1).squeeze(-1)
    return {
        name: samples[site][(slice(None), slice(None), *index)].double().cpu().numpy()
        for name, (site, index) in located.items()
    }
