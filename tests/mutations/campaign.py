# ruff: noqa: E501 (the table of mutations quotes source lines whole)
"""Mutation campaign: does the quick tier catch plausible one-line bugs? (issues 15, 34)

Not collected by pytest (no ``test_`` prefix). Each mutation replaces one exact source
string in ``pyro_bdl/`` (it must occur exactly once), runs the quick-tier tests listed for
it (``tests/`` only, never ``validation/``: the tests of the mutated module that can see
the bug; ``-x -q``, one thread, ``timeout 300``) and restores the file. A mutation is
*caught* when the tests fail; the listed tests first run together on the unmutated copy,
which must pass. It runs on a copy of the checkout, so the worktree is never touched:

    python tests/mutations/campaign.py [--only ID ...] [--out tests/mutations/RESULTS.md]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

os.environ.update(
    OMP_NUM_THREADS="1",
    HF_HUB_OFFLINE="1",
    TRANSFORMERS_OFFLINE="1",
    TOKENIZERS_PARALLELISM="false",
)
ROOT = Path(__file__).resolve().parents[2]
# Imported once by the campaign, before it forks a child per mutation.
PREIMPORT = [
    "torch",
    "pyro",
    "numpy",
    "scipy",
    "sklearn",
    "transformers",
    "peft",
    "arviz",
    "xarray",
    "ivon",
    "laplace",
    "laplace.curvature",
]
SG = "pyro_bdl/inference/sgmcmc/"
LA = "pyro_bdl/inference/laplace/"
VI = "pyro_bdl/inference/vi/"
T_SG = [
    "tests/inference/sgmcmc/test_zero_temperature.py",
    "tests/inference/sgmcmc/test_kernel.py::test_a_constrained_site_without_data_has_the_prior_moments",
]
POSTERIOR = "tests/inference/sgmcmc/test_posterior.py::"
T_SGLD = [POSTERIOR + "test_draws_match_the_tempered_posterior[sgld-T1]"]
T_SGHMC = [POSTERIOR + "test_draws_match_the_tempered_posterior[sghmc-mass2-T1]"]
T_SGNHT = [POSTERIOR + "test_sgnht_draws_match_the_posterior"]
T_EQ = ["tests/inference/sgmcmc/test_equilibrium.py"]
T_LA = [
    "tests/inference/laplace/test_evidence.py",
    "tests/inference/laplace/curvature",
    "tests/inference/laplace/test_laplace_guide.py",
]
T_GLM = ["tests/inference/laplace/test_glm_predictive.py"]
T_FLIPOUT = ["tests/inference/vi/test_flipout.py"]
T_KL = [
    "tests/inference/vi/test_kl_weights.py",
    "tests/inference/vi/test_blob_svi.py",
    "tests/inference/vi/test_blob.py",
]
T_IVON = ["tests/inference/vi/test_ivon.py"]

# (id, file, old, new, test paths)
MUTATIONS = [
    # -- SGMCMC: noise, drift scaling, mass, thermostat, prior, Jacobian
    (
        "sgld-noise-no-2",
        SG + "sgld.py",
        "math.sqrt(2 * step_size * self.temperature",
        "math.sqrt(step_size * self.temperature",
        T_SG + T_SGLD,
    ),
    (
        "sgld-noise-10pct",
        SG + "sgld.py",
        "math.sqrt(2 * step_size * self.temperature",
        "math.sqrt(2.2 * step_size * self.temperature",
        T_SG + T_SGLD,
    ),
    (
        "sgld-drift-no-N",
        SG + "sgld.py",
        "torch._foreach_add_(theta, grads, alpha=step_size / num_data)",
        "torch._foreach_add_(theta, grads, alpha=step_size)",
        T_SG + T_SGLD,
    ),
    (
        "sgld-noise-no-N",
        SG + "sgld.py",
        "math.sqrt(2 * step_size * self.temperature / num_data)",
        "math.sqrt(2 * step_size * self.temperature)",
        T_SG + T_SGLD,
    ),
    (
        "sghmc-noise-no-friction",
        SG + "sghmc.py",
        "math.sqrt(2 * step_size * self.temperature * self.friction / num_data)",
        "math.sqrt(2 * step_size * self.temperature / num_data)",
        T_SG + T_SGHMC,
    ),
    (
        "sghmc-friction-no-mass",
        SG + "sghmc.py",
        "1 - step_size * self.friction / self.mass",
        "1 - step_size * self.friction",
        T_SG + T_SGHMC,
    ),
    (
        "sghmc-position-no-mass",
        SG + "sghmc.py",
        "torch._foreach_add_(theta, m, alpha=step_size / self.mass)",
        "torch._foreach_add_(theta, m, alpha=step_size)",
        T_SG + T_SGHMC,
    ),
    (
        "sghmc-noise-times-mass",
        SG + "sghmc.py",
        "math.sqrt(2 * step_size * self.temperature * self.friction / num_data)",
        "math.sqrt(2 * step_size * self.temperature * self.friction * self.mass / num_data)",
        T_SG + T_SGHMC,
    ),
    (
        "sghmc-kinetic-no-mass",
        SG + "sghmc.py",
        "square().sum() / self.mass",
        "square().sum()",
        T_EQ,
    ),
    (
        "sgnht-friction-no-mass",
        SG + "sgnht.py",
        "return 1 - (step_size / self.mass) * self.state.thermostat",
        "return 1 - step_size * self.state.thermostat",
        T_SG + T_SGNHT,
    ),
    (
        "sgnht-thermostat-target-no-N",
        SG + "sgnht.py",
        "target = (self.temperature / self.num_data) / (1 - rate)",
        "target = self.temperature / (1 - rate)",
        T_SG + T_SGNHT,
    ),
    (
        "sgnht-refresh-no-mass",
        SG + "sghmc.py",
        "variance = self.mass * self._free_kinetic_temperature(",
        "variance = self._free_kinetic_temperature(",
        T_EQ + T_SGNHT,
    ),
    (
        "sgnht-thermostat-sign",
        SG + "sgnht.py",
        "state.thermostat.add_(step_size * (kinetic - target))",
        "state.thermostat.add_(step_size * (target - kinetic))",
        T_SGNHT + T_EQ,
    ),
    (
        "prior-score-drops-mean",
        "pyro_bdl/inference/log_joint.py",
        "grads[name].add_(loc * coefficient)",
        "grads[name].add_(loc)",
        T_SG + T_SGLD + ["tests/inference/test_log_joint.py"],
    ),
    (
        "prior-score-scale-not-squared",
        "pyro_bdl/inference/log_joint.py",
        "scale / fn.scale_value**2)",
        "scale / fn.scale_value)",
        T_SG + T_SGLD + ["tests/inference/test_log_joint.py"],
    ),
    (
        "sgmcmc-drops-log-jacobian",
        SG + "target.py",
        "log_joint.autograd_value = log_joint.autograd_value + log_jacobian",
        "log_joint.autograd_value = log_joint.autograd_value",
        T_SG,
    ),
    (
        "observe-no-N-over-B",
        "pyro_bdl/likelihoods.py",
        'pyro.plate(f"{name}_data", size=num_data, subsample=indices)',
        'pyro.plate(f"{name}_data", size=len(indices), subsample=indices)',
        ["tests/test_likelihoods.py", "tests/inference/test_log_joint.py"] + T_SG + T_SGLD,
    ),
    # -- Laplace: N / n_seen, evidence, K-FAC, links, predictive
    (
        "laplace-curvature-no-N-over-seen",
        LA + "curvature_pass.py",
        "blocks = tuple(curvature.blocks(num_data / seen))",
        "blocks = tuple(curvature.blocks(1.0))",
        T_LA,
    ),
    (
        "laplace-loglik-no-N-over-seen",
        LA + "curvature_pass.py",
        "return log_likelihood * scale, score, num_data, seen, jacobians",
        "return log_likelihood, score, num_data, seen, jacobians",
        T_LA,
    ),
    (
        "evidence-drops-prior-mean",
        LA + "evidence.py",
        "(delta * (value - mean).square()).sum()",
        "(delta * value.square()).sum()",
        T_LA,
    ),
    ("evidence-log-det-sign", LA + "evidence.py", "- 0.5 * log_det", "+ 0.5 * log_det", T_LA),
    (
        "evidence-drops-2pi",
        LA + "evidence.py",
        "log_prior = log_prior - 0.5 * gaussian * math.log(2 * math.pi)",
        "log_prior = log_prior",
        T_LA,
    ),
    (
        "laplace-gradient-drops-prior-mean",
        LA + "model_prior.py",
        "prior.precision[name] * (value - prior.loc[name])",
        "prior.precision[name] * value",
        T_LA + ["tests/inference/laplace/test_mode.py"],
    ),
    (
        "kron-eigenbasis-transpose",
        LA + "curvature/kron.py",
        "self.output_vectors @ (self._project(x) * weights) @ self.input_vectors.mT",
        "self.output_vectors @ (self._project(x) * weights) @ self.input_vectors",
        T_LA,
    ),
    (
        "kron-project-transpose",
        LA + "curvature/kron.py",
        "return self.output_vectors.mT @ self._matrix(x) @ self.input_vectors",
        "return self.output_vectors @ self._matrix(x) @ self.input_vectors",
        T_LA,
    ),
    (
        "kron-input-factor-per-example",
        LA + "curvature/kron.py",
        "self.rows[site] += inputs[site].shape[0]",
        "self.rows[site] += len(grad.inputs)",
        T_LA,
    ),
    (
        "kron-diagonal-no-scale",
        LA + "curvature/kron.py",
        "blocks.append(DiagonalBlock(site, self.diagonals[site] * scale))",
        "blocks.append(DiagonalBlock(site, self.diagonals[site]))",
        T_LA,
    ),
    (
        "diag-curvature-no-scale",
        LA + "curvature/diagonal.py",
        "return [DiagonalBlock(site, total * scale) for site, total in self.sums.items()]",
        "return [DiagonalBlock(site, total) for site, total in self.sums.items()]",
        T_LA,
    ),
    (
        "fisher-mc-averages-not-root",
        LA + "observation.py",
        "columns = torch.stack(draws) / math.sqrt(num_samples)",
        "columns = torch.stack(draws) / num_samples",
        T_LA,
    ),
    (
        "fisher-ef-at-sampled-labels",
        LA + "observation.py",
        "self.family.score(self.base, f, self.value).unsqueeze(0)",
        "self.family.score(self.base, f, self.base.sample()).unsqueeze(0)",
        T_LA,
    ),
    (
        "probit-no-sqrt",
        LA + "predictive.py",
        "(1 + math.pi / 8 * variance).sqrt()",
        "(1 + math.pi / 8 * variance)",
        T_GLM + T_LA,
    ),
    (
        "bridge-class-power",
        LA + "predictive.py",
        "cross / num_classes**2",
        "cross / num_classes",
        T_GLM + T_LA,
    ),
    (
        "mc-link-variance-not-sd",
        LA + "predictive.py",
        "values.clamp(min=0).sqrt().unsqueeze(-2)",
        "values.clamp(min=0).unsqueeze(-2)",
        T_GLM + T_LA,
    ),
    (
        "blocknormal-temperature-not-sqrt",
        LA + "laplace_prior.py",
        "math.sqrt(self.temperature) * draws",
        "self.temperature * draws",
        ["tests/inference/laplace/test_laplace_prior.py"],
    ),
    # -- metrics, ArviZ
    (
        "ece-unweighted-bins",
        "pyro_bdl/metrics.py",
        "weights = self.count.double() / self.count.sum()",
        "weights = (self.count > 0) / (self.count > 0).sum()",
        ["tests/test_metrics.py"],
    ),
    (
        "ece-left-closed-bins",
        "pyro_bdl/metrics.py",
        "bins = torch.bucketize(confidence, edges[1:-1])",
        "bins = torch.bucketize(confidence, edges[1:-1], right=True)",
        ["tests/test_metrics.py"],
    ),
    (
        "predictive-returns-data",
        "pyro_bdl/arviz.py",
        '            site["value"].cpu().numpy(),\n',
        "            observed.cpu().numpy(),\n",
        ["tests/test_arviz.py"],
    ),
    (
        "arviz-guide-seed-ignored",
        "pyro_bdl/arviz.py",
        "posterior.draws(num_samples, *model_args, seed=seed, **model_kwargs)",
        "posterior.draws(num_samples, *model_args, seed=0, **model_kwargs)",
        ["tests/test_arviz.py"],
    ),
    # -- VI: flipout, BLoB KL weight, IVON
    (
        "flipout-signs-shared-by-the-batch",
        VI + "flipout.py",
        "torch.randint(0, 2, h.shape[:-1] + (n + r,),",
        "torch.randint(0, 2, (n + r,),",
        T_FLIPOUT,
    ),
    (
        # (Flipping the output signs' sign, the former mutant here, is no bug: -t is as
        # Rademacher as t, so no test of the method's distribution can tell them apart.)
        "flipout-output-signs-half",
        VI + "flipout.py",
        "torch.addcmul(F.linear(h, mean) - y, y, bits_t, value=2.0)",
        "torch.addcmul(F.linear(h, mean) - y, y, bits_t, value=1.0)",
        T_FLIPOUT,
    ),
    (
        "blob-kl-weight-doubled",
        VI + "kl_weights.py",
        "math.ldexp(1.0, i - cycle - 1)",
        "math.ldexp(1.0, i - cycle)",
        T_KL,
    ),
    (
        "blob-svi-kl-unweighted",
        VI + "blob_svi.py",
        "(kl_weight * kl).backward()",
        "kl.backward()",
        T_KL,
    ),
    (
        "warmup-fractional-steps",
        VI + "blob_svi.py",
        "warmup = math.ceil(num_steps * warmup_ratio)",
        "warmup = num_steps * warmup_ratio",
        ["tests/inference/vi/test_blob_svi.py"],
    ),
    (
        "ivon-hessian-no-correction",
        VI + "ivon_svi.py",
        ".add_(correction, alpha=0.5 * (1 - beta2) ** 2)",
        "",
        T_IVON,
    ),
    (
        "ivon-no-debias",
        VI + "ivon_svi.py",
        "self.momentum.div(1 - beta1**self.step_count)",
        "self.momentum.clone()",
        T_IVON,
    ),
    (
        "ivon-hessian-no-ess",
        VI + "ivon_svi.py",
        "hess_nll = noise_grad.mul_(precision).mul_(guide.ess)",
        "hess_nll = noise_grad.mul_(precision)",
        T_IVON,
    ),
    (
        "ivon-scale-no-ess",
        VI + "ivon.py",
        "torch.rsqrt(self.ess * precision)",
        "torch.rsqrt(precision)",
        T_IVON,
    ),
    (
        "ivon-decay-no-N",
        VI + "ivon.py",
        'self.sites[name].message["scale"] / (num_data * prior[1].square())',
        'self.sites[name].message["scale"] / prior[1].square()',
        T_IVON,
    ),
    (
        "thin-off-by-one",
        SG + "base.py",
        "for inner in range(1 if warmup else self.thin):",
        "for inner in range(1 if warmup else self.thin + 1):",
        ["tests/inference/sgmcmc/test_kernel.py"],
    ),
    (
        "sgld-temperature-squared",
        SG + "sgld.py",
        "math.sqrt(2 * step_size * self.temperature / num_data)",
        "math.sqrt(2 * step_size * self.temperature**2 / num_data)",
        T_SG + [POSTERIOR + "test_draws_match_the_tempered_posterior[sgld-T0.5]"],
    ),
    (
        "sghmc-temperature-not-in-noise",
        SG + "sghmc.py",
        "math.sqrt(2 * step_size * self.temperature * self.friction / num_data)",
        "math.sqrt(2 * step_size * self.friction / num_data)",
        T_SG + [POSTERIOR + "test_draws_match_the_tempered_posterior[sghmc-mass0.5-T0.5]"],
    ),
    # -- checkpoints, baselines
    (
        "checkpoint-rng-not-restored",
        SG + "checkpoint.py",
        'torch.set_rng_state(tensors["rng/cpu"])',
        "torch.get_rng_state()",
        ["tests/inference/sgmcmc/test_checkpoint.py"],
    ),
    (
        "map-ignores-weight-decay",
        "pyro_bdl/inference/baselines.py",
        '"weight_decay": weight_decay, "lr_lambda": factor}',
        '"weight_decay": 0.0, "lr_lambda": factor}',
        ["tests/inference/test_baselines.py"],
    ),
    (
        "bbb-prior-ignored",
        "pyro_bdl/inference/baselines.py",
        'desc="BBB", disable=not progress, leave=False)\n    with _prior(net, prior_std):',
        'desc="BBB", disable=not progress, leave=False)\n    with _prior(net, None):',
        ["tests/inference/test_baselines.py"],
    ),
]


def run(mutation, copy: Path, timeout: int) -> tuple[str, str]:
    """Apply one mutation in ``copy``, run its tests in a forked child, restore the file.

    The child is forked from a process that has imported torch, pyro, transformers and
    the rest once (but not pyro_bdl, which the child imports from the mutated copy):
    a fresh interpreter per mutation spends most of its time importing them.
    """
    ident, path, old, new, tests = mutation
    outside = [test for test in tests if not test.startswith("tests/")]
    if outside:  # the campaign judges the quick tier, `make test`
        return "invalid", f"not quick-tier tests: {outside}"
    source = copy / (path or "pyproject.toml")
    text = source.read_text()
    if path is not None and text.count(old) != 1:
        return "invalid", f"the string occurs {text.count(old)} times"
    if path is not None:
        source.write_text(text.replace(old, new))
    log = copy / "mutation.log"
    try:
        pid = os.fork()
        if pid == 0:  # the child: run pytest on the mutated copy, exit with its status
            with open(log, "w") as out:
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
            os.chdir(copy)
            sys.path.insert(0, str(copy))
            signal.alarm(timeout)
            args = ["-x", "-q", "-p", "no:cacheprovider", "-W", "ignore", *tests]
            os._exit(int(pytest.main(args)))
        _, status = os.waitpid(pid, 0)
    finally:
        source.write_text(text)
    if os.WIFSIGNALED(status):
        return "timeout", f"killed by signal {os.WTERMSIG(status)} after {timeout} s or less"
    code = os.WEXITSTATUS(status)
    if code == 0:
        return "survived", ""
    if code in (pytest.ExitCode.USAGE_ERROR, pytest.ExitCode.NO_TESTS_COLLECTED):
        return "invalid", f"pytest exit code {code}: a listed test does not exist"
    failed = [line for line in log.read_text().splitlines() if line.startswith(("FAILED", "ERROR"))]
    return "caught", failed[0].split(" - ")[0].split(" ", 1)[-1] if failed else f"rc {code}"


def checkout_copy(tmp: Path) -> Path:
    """A copy of the library and its tests whose ``../shared`` is the checkout's."""
    copy = tmp / "root"
    copy.mkdir()
    for name in ("pyro_bdl", "tests", "examples", "experiments", "pyproject.toml", "conftest.py"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, copy / name)
        elif (ROOT / name).exists():
            shutil.copy(ROOT / name, copy / name)
    shared = (ROOT / "../shared").resolve()
    if shared.exists():
        (tmp / "shared").symlink_to(shared)
    return copy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--jobs", type=int, default=1, help="mutations run at once")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per mutation")
    parser.add_argument("--out", default=str(ROOT / "tests/mutations/RESULTS.md"))
    options = parser.parse_args()
    chosen = [m for m in MUTATIONS if not options.only or m[0] in options.only]
    for name in PREIMPORT:  # once, before forking; never pyro_bdl
        try:
            importlib.import_module(name)
        except ImportError:  # a peer not installed: its tests skip
            pass
    with tempfile.TemporaryDirectory() as tmp:
        # Control: every listed test passes on the unmutated copy, or no failure means much.
        union = sorted({test for mutation in chosen for test in mutation[4]})
        (Path(tmp) / "control").mkdir()
        verdict, where = run(
            ("control", None, "", "", union),
            checkout_copy(Path(tmp) / "control"),
            4 * options.timeout,
        )
        print(f"{'control (no mutation)':40s} {verdict:9s} {where}", flush=True)
        if verdict != "survived":
            raise SystemExit(f"the unmutated tests do not pass ({verdict}: {where})")
        workers = []
        for job in range(options.jobs):
            (Path(tmp) / str(job)).mkdir()
            copy = checkout_copy(Path(tmp) / str(job))
            pid = os.fork()
            if pid == 0:  # a worker: every jobs-th mutation, one after another
                rows = []
                for mutation in chosen[job :: options.jobs]:
                    start = time.time()
                    verdict, where = run(mutation, copy, options.timeout)
                    rows.append((mutation[0], mutation[1], verdict, where, time.time() - start))
                    print(
                        f"{rows[-1][0]:40s} {verdict:9s} {where} ({rows[-1][4]:.0f}s)", flush=True
                    )
                (Path(tmp) / f"{job}.json").write_text(json.dumps(rows))
                os._exit(0)
            workers.append(pid)
        for pid in workers:
            os.waitpid(pid, 0)
        found = {}
        for job in range(options.jobs):
            for row in json.loads((Path(tmp) / f"{job}.json").read_text()):
                found[row[0]] = row
    rows = [found[m[0]] for m in chosen]
    caught = sum(r[2] == "caught" for r in rows)
    valid = sum(r[2] != "invalid" for r in rows)
    lines = [
        "# Mutation campaign (issues 15 and 34)",
        "",
        "`python tests/mutations/campaign.py --jobs 2` (each mutation: the listed quick-tier",
        "tests of the mutated module, `pytest -x -q`, one thread, a time limit; a timeout is",
        "not counted as caught; the listed tests first pass together on the unmutated copy).",
        "",
        f"{caught} of {valid} caught ({100 * caught / max(valid, 1):.0f} %).",
        "",
        "| mutation | file | verdict | first failing test | seconds |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.0f} |" for r in rows]
    Path(options.out).write_text("\n".join(lines) + "\n")
    print(lines[5])


if __name__ == "__main__":
    main()
