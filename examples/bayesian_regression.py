"""Bayesian linear regression with SGLD and SGHMC, checked against the exact posterior.

A plain Pyro model (``pyro.sample`` for the weights, :func:`pyro_bdl.observe` for the
minibatch likelihood) is sampled by the stochastic-gradient kernels through Pyro's own
``MCMC``, one fresh minibatch per step. The model is conjugate, so the exact posterior
is known: the script draws it beside the chains, and exports the draws to ArviZ for a
trace plot and a summary (R-hat, effective sample sizes).

    python examples/bayesian_regression.py --out results/bayesian_regression

Writes ``posterior.png`` (draws against the exact posterior), ``trace.png`` (ArviZ trace
plot) and ``posterior.nc`` (the SGHMC draws as an ArviZ DataTree). About a minute on a
laptop CPU; ``--quick`` runs a few seconds.
"""

import argparse
from pathlib import Path

import arviz_plots
import arviz_stats
import numpy as np
import pyro
import pyro.distributions as dist
import torch
from matplotlib.figure import Figure
from pyro.infer import MCMC

import pyro_bdl as bdl
from pyro_bdl.inference import SGHMC, SGLD

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--out", default="results/bayesian_regression")
parser.add_argument("--quick", action="store_true", help="a few seconds, for CI")
args = parser.parse_args()
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
pyro.set_rng_seed(0)

# -- data: y = 0.5 + x @ [1.0, -0.5] + noise, with correlated features -----------------
NUM_DATA, NOISE, PRIOR_SCALE = 500, 0.5, 1.0
x = torch.randn(NUM_DATA, 2) @ torch.tensor([[1.0, 0.8], [0.0, 0.6]])
y = 0.5 + x @ torch.tensor([1.0, -0.5]) + NOISE * torch.randn(NUM_DATA)
loader = bdl.data.TensorLoader((x, y), batch_size=50, shuffle=True, drop_last=True)


# -- the model: an ordinary Pyro model; observe() scales the minibatch by N / B ---------
def model(batch, num_data):
    x, y = batch
    w = pyro.sample("w", dist.Normal(0.0, PRIOR_SCALE).expand([2]).to_event(1))
    b = pyro.sample("b", dist.Normal(0.0, PRIOR_SCALE))
    bdl.observe("y", dist.Normal(b + x @ w, NOISE), y, num_data)


# -- the exact posterior of theta = (b, w): N(mean, inverse(precision)) ----------------
features = torch.cat([torch.ones(NUM_DATA, 1), x], dim=1).double()
precision = features.T @ features / NOISE**2 + torch.eye(3) / PRIOR_SCALE**2
covariance = torch.linalg.inv(precision)
mean = covariance @ features.T @ y.double() / NOISE**2

# -- SGLD and SGHMC through pyro.infer.MCMC, two chains each -----------------------------
num_samples, warmup = (100, 100) if args.quick else (1000, 1000)
runs = {}
for name, kernel in {
    "SGLD": SGLD(model, step_size=0.02, thin=5),
    "SGHMC": SGHMC(model, step_size=0.05, friction=1.0, thin=5),
}.items():
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup, num_chains=2)
    mcmc.run(loader, NUM_DATA)
    runs[name] = mcmc

# -- ArviZ: summary (R-hat, ESS) and trace plot ------------------------------------------
idata = bdl.to_arviz(runs["SGHMC"])
print(arviz_stats.summary(idata, var_names=["b", "w"]).to_string())
print(
    "exact posterior mean", mean.numpy().round(3), "sd", covariance.diag().sqrt().numpy().round(3)
)
idata.to_netcdf(out / "posterior.nc", engine="h5netcdf")
arviz_plots.plot_trace_dist(idata, var_names=["b", "w"], backend="matplotlib").savefig(
    out / "trace.png"
)

# -- the draws against the exact posterior -----------------------------------------------
fig = Figure(figsize=(10, 3.6), layout="constrained")
axes = fig.subplots(1, 3)
grid = torch.linspace(-4, 4, 200, dtype=torch.float64)
for i, (ax, label) in enumerate(zip(axes[:2], ["w[0]", "w[1]"])):
    sd = covariance[i + 1, i + 1].sqrt()
    ax.plot(mean[i + 1] + sd * grid, dist.Normal(0.0, 1.0).log_prob(grid).exp() / sd, "k-")
    for mcmc in runs.values():
        ax.hist(mcmc.get_samples()["w"][:, i].numpy(), bins=40, density=True, histtype="step")
    ax.set(title=f"marginal of {label}", xlabel=label)
axes[0].legend(["exact", *runs], fontsize="small")
# The joint of (w[0], w[1]): draws and the exact 1- and 2-sd ellipses.
ax = axes[2]
for name, mcmc in runs.items():
    w = mcmc.get_samples()["w"].numpy()
    ax.scatter(w[:, 0], w[:, 1], s=3, alpha=0.4, label=name)
angles = np.linspace(0, 2 * np.pi, 100)
circle = np.stack([np.cos(angles), np.sin(angles)])
root = np.linalg.cholesky(covariance[1:, 1:].numpy())
for radius in (1, 2):
    ellipse = mean[1:].numpy()[:, None] + radius * root @ circle
    ax.plot(ellipse[0], ellipse[1], "k-", linewidth=1)
ax.set(title="joint of w (exact: 1 and 2 sd)", xlabel="w[0]", ylabel="w[1]")
ax.legend(fontsize="small", markerscale=3)
fig.savefig(out / "posterior.png", dpi=120)
print(f"wrote {out}/posterior.png, trace.png, posterior.nc")
