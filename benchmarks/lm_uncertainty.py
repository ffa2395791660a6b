"""Per-token uncertainty and generation under a posterior: cost against the plain model's.

One Llama-architecture causal LM with random weights (``--size``), LoRA r 8 on q_proj /
v_proj with non-zero B (a fine-tuned look), and ``S`` draws of the adapters. Rows, each a
ratio of two things measured side by side in this process (interleaved rounds, the median
of each):

===============================================  ==================================  ======
measure                                          against                             target
===============================================  ==================================  ======
``token_uncertainty`` with S draws, per draw     one plain peft forward (a draw's     1.1
                                                 weights in place), and one call of
                                                 the Pyro model (its likelihood
                                                 normalises the logits: a pass over
                                                 ``(B, L, V)`` of its own)
``token_uncertainty`` peak memory, S = 16        the same with S = 4 (and S = 1)     1.0
``generate`` with S draws, tokens per second     Hugging Face ``generate`` run S     0.9
                                                 times, tokens per second
===============================================  ==================================  ======

The first is the streaming decomposition's own cost (a softmax, an entropy and a running
sum over the vocabulary per draw and position) above the network's forward; the second
says memory is flat in S (one draw's logits and running sums, never ``(S, B, L, V)``;
against S = 1 the peak is higher by the running sums, which a single draw's forward does
not hold yet, so flat is measured from S = 4); the third is the price of decoding from the
model average with one key-value cache per draw
(the ratio is HF's tokens per second times S over ours' over S draws: 1 means the same
cost as S separate greedy decodes, which give no model average and no uncertainty).

Sizes: ``tiny`` (a smoke test, the default of ``make bench``), ``proxy`` (the CPU proxy:
width 1024 with Llama 2's vocabulary of 32,000, so that the vocabulary-wide work weighs
what it weighs at scale against the LM head), ``1b`` and ``7b`` (TinyLlama's and Llama 2
7B's shapes, for a GPU: ``--device cuda --dtype bfloat16``, the adapters in float32).

Memory as in ``llm_scale.py`` (whose :class:`Memory` this reuses): CUDA
``max_memory_allocated`` above what was held before the call, CPU the peak resident set
size over the call from the kernel's high-water mark.

Run::

    python benchmarks/lm_uncertainty.py --size proxy
    python benchmarks/lm_uncertainty.py --size 7b --device cuda --dtype bfloat16

Machine load moves wall-clock figures: read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import pyro
import torch
from llm_scale import SIZES as LLM_SIZES
from llm_scale import Memory, random_llama, synchronize

from pyro_bdl import lm
from pyro_bdl.models import lora_model

NUM_DATA = 10_000
SIZES = {
    "tiny": dict(
        model=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=128, vocab_size=1000),
        batch_size=2, length=32, prompt=8, new_tokens=8,
    ),
    "proxy": dict(
        model=dict(hidden_size=1024, num_hidden_layers=2, num_attention_heads=8,
                   intermediate_size=2816, vocab_size=32000),
        batch_size=4, length=128, prompt=32, new_tokens=32,
    ),
    "1b": dict(model=LLM_SIZES["1b"]["model"], batch_size=4, length=256, prompt=64,
               new_tokens=64),
    "7b": dict(model=LLM_SIZES["7b"]["model"], batch_size=4, length=256, prompt=64,
               new_tokens=64),
}  # fmt: skip


def build(args: argparse.Namespace):
    """The LoRA causal LM, a batch, prompts and ``max(args.draws)`` draws of the adapters."""
    size = SIZES[args.size]
    base = random_llama(size["model"], args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lora = lora_model(base, "causal_lm", rank=8, alpha=16, dropout=0.0)
    for name, param in lora.peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    generator = torch.Generator().manual_seed(args.seed)
    shape = (size["batch_size"], size["length"])
    input_ids = torch.randint(3, base.config.vocab_size, shape, generator=generator)
    batch = {"input_ids": input_ids, "labels": input_ids}
    prompts = input_ids[:, : size["prompt"]].to(args.device)
    values = lora.net.init_values()
    draws = {
        site: value + 0.01 * torch.randn(max(args.draws), *value.shape).to(value)
        for site, value in values.items()
    }
    return lora, batch, prompts, draws


def subset(draws: dict, count: int) -> dict:
    return {site: value[:count] for site, value in draws.items()}


def cases(args, lora, batch, prompts, draws) -> dict:
    """name -> (callable, units per call): what is timed."""
    new_tokens = SIZES[args.size]["new_tokens"]
    first = {site: value[0] for site, value in draws.items()}

    @torch.no_grad()
    def forward():
        # the plain peft forward with one draw's weights: no Pyro, no decomposition
        with lora.net.fixed(first):
            lora.peft_model(input_ids=batch["input_ids"].to(args.device), use_cache=False)

    @torch.no_grad()
    def model_forward():
        # the Pyro model's own call with one draw (its likelihood normalises the logits)
        with lora.net.fixed(first):
            lora.model(batch, NUM_DATA)

    def hf_generate():
        with lora.net.fixed(first), torch.no_grad():
            out = lora.peft_model.generate(
                input_ids=prompts,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
            )
        assert out.shape[1] == prompts.shape[1] + new_tokens

    table = {
        "forward": (forward, 1),
        "model_forward": (model_forward, 1),
        "hf_generate": (hf_generate, 1),
    }
    for count in args.draws:
        table[f"uncertainty_S{count}"] = (
            lambda count=count: lm.token_uncertainty(
                lora.model, batch, NUM_DATA, samples=subset(draws, count)
            ),
            count,
        )
        table[f"generate_S{count}"] = (
            lambda count=count: lm.generate(
                lora.model,
                prompts,
                samples=subset(draws, count),
                max_new_tokens=new_tokens,
                eos_token_id=[],
            ),
            count,
        )
    return table


def measure(table, rounds, memory, device) -> tuple[dict, dict]:
    """Median seconds per unit and peak memory of every case, in interleaved rounds."""
    names = list(table)
    for name in names:  # warm-up: allocator, caches
        table[name][0]()
    times = {name: [] for name in names}
    peaks = {name: {} for name in names}
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            run, units = table[name]
            with memory.measure(peaks[name]):
                synchronize(device)
                start = time.perf_counter()
                run()
                synchronize(device)
            times[name].append((time.perf_counter() - start) / units)
    return {name: statistics.median(values) for name, values in times.items()}, peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    parser.add_argument("--draws", type=int, nargs="+", default=[1, 4, 16], help="values of S")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    args.draws = sorted(set(args.draws))
    if args.threads:
        torch.set_num_threads(args.threads)
    pyro.set_rng_seed(args.seed)
    memory = Memory(device)
    lora, batch, prompts, draws = build(args)
    memory.model_built()
    size = SIZES[args.size]
    print(
        f"Llama {args.size} ({size['model']['num_hidden_layers']} layers, width "
        f"{size['model']['hidden_size']}, vocabulary {size['model']['vocab_size']}), LoRA r 8 "
        f"on q_proj/v_proj; batch {size['batch_size']} x {size['length']} tokens; generation "
        f"{size['batch_size']} prompts of {size['prompt']} + {size['new_tokens']} tokens; "
        f"{args.device} {args.dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    seconds, peaks = measure(cases(args, lora, batch, prompts, draws), args.rounds, memory, device)
    unit = "MiB allocated" if device.type == "cuda" else "MiB resident"
    print("\n| case | time per draw (per call for the baselines) | peak above the model |")
    print("|---|---|---|")
    for name, value in seconds.items():
        print(f"| {name} | {1e3 * value:.1f} ms | {peaks[name]['above']:.0f} {unit} |")
    high = args.draws[-1]
    print("\n| measure | ratio | target |")
    print("|---|---|---|")
    for count in args.draws:
        for baseline in ("forward", "model_forward"):
            ratio = seconds[f"uncertainty_S{count}"] / seconds[baseline]
            print(
                f"| token_uncertainty per draw / {baseline}, S = {count} | {ratio:.3f} | <= 1.1 |"
            )
    # From the second draw on, the running sums (one (B, L, V) mean) are held during the
    # forward; with one draw they are not yet: flat in S means flat from S = 2 on.
    for base in args.draws[:2]:
        if base < high:
            ratio = peaks[f"uncertainty_S{high}"]["above"] / max(
                peaks[f"uncertainty_S{base}"]["above"], 1e-9
            )
            print(f"| token_uncertainty peak memory, S = {high} / S = {base} | {ratio:.2f} | 1.0 |")
    for count in args.draws:
        # tokens per second of ours over those of S separate HF decodes
        ratio = seconds["hf_generate"] / seconds[f"generate_S{count}"]
        print(f"| generate tokens/s / (HF generate tokens/s / S), S = {count} | {ratio:.2f} "
              "| >= 0.9 |")  # fmt: skip


if __name__ == "__main__":
    main()
