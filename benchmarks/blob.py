"""BLoB's training step against a plain LoRA step on MiniLM: time and peak-memory ratios.

Both steps train the same MiniLM + LoRA classifier (rank 8 on the queries and values, a
trainable head) on the same batch of IMDB reviews. The plain step is what peft alone does:
forward, mean cross entropy, backward, one AdamW step. The BLoB step is
:meth:`pyro_bdl.inference.BLoBSVI.step`: guide and model traces, flipout at the LoRA A
projections, the AdamW step on the NLL and the SGD step on the re-weighted KL. The steps
are timed alternately in one process, so that load on the machine affects both alike;
peak memory is measured in a fresh process per method, from just before the first step
(CPU: the peak resident set size, which Linux resets through ``/proc/self/clear_refs``;
CUDA: peak allocated memory), in total and above the memory held before the first step.

Targets (the paper measured +15% time and +3-13% memory on Llama2-7B): time ratio <= 1.20,
memory ratio <= 1.15.

Run::

    python benchmarks/blob.py                                  # batch 8 x 128 tokens
    python benchmarks/blob.py --threads 1                      # on a shared, busy CPU
    python benchmarks/blob.py --batch-size 32 --max-length 256 --steps 20
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.utils import logging

import pyro_bdl as bdl
from pyro_bdl.data import ClassificationCollator, load
from pyro_bdl.inference import BLoBGuide, BLoBSVI
from pyro_bdl.models import BayesianNet, Classification, lora_model

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
METHODS = ("lora", "blob")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per method")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per method")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="CPU threads of torch"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-of", choices=METHODS, help=argparse.SUPPRESS)
    return parser.parse_args()


def make_batch(args: argparse.Namespace, tokenizer) -> dict[str, torch.Tensor]:
    reviews = load("imdb", args.data_dir, "train", limit=args.batch_size, seed=args.seed)
    collate = ClassificationCollator(tokenizer, max_length=args.max_length)
    batch = collate(list(reviews))
    return {key: value.to(args.device) for key, value in batch.items()}


def make_step(method: str, args: argparse.Namespace):
    """A fresh MiniLM-LoRA and a function taking one training step on a batch."""
    torch.manual_seed(args.seed)
    lora = lora_model(
        "minilm", "classification", num_labels=2, rank=args.rank, alpha=args.rank, dropout=0.0
    )
    peft_model = lora.peft_model.to(args.device)
    num_data = 25_000
    if method == "lora":
        trainable = [p for p in peft_model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=5e-4, eps=1e-6)

        def step(batch):
            inputs = {key: value for key, value in batch.items() if key != "labels"}
            loss = F.cross_entropy(peft_model(**inputs).logits, batch["labels"])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()

        return lora.tokenizer, step
    # BLoB: A random, B and the head point weights (section 3.1).
    net = bdl.lift(
        peft_model,
        bdl.priors.IIDNormal(0.2),
        random="lora_A",
        point=lambda name, p: "lora_B" in name or "modules_to_save" in name,
    )
    model = BayesianNet(net, Classification())
    guide = BLoBGuide(model, net, prior_std=0.2)
    svi = BLoBSVI(model, guide, num_steps=10**6, warmup_ratio=0.0)
    return lora.tokenizer, lambda batch: svi.step(batch, num_data)["nll"]


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_steps(args: argparse.Namespace) -> dict[str, list[float]]:
    steps, batch = {}, None
    for method in METHODS:
        tokenizer, steps[method] = make_step(method, args)
        batch = batch if batch is not None else make_batch(args, tokenizer)
    for method in METHODS:
        for _ in range(args.warmup):
            steps[method](batch)
    times = {method: [] for method in METHODS}
    for round_ in range(args.steps):
        # Alternate the order so that a drift in the machine's load cancels.
        for method in METHODS if round_ % 2 == 0 else METHODS[::-1]:
            synchronize(args.device)
            start = time.perf_counter()
            steps[method](batch)
            synchronize(args.device)
            times[method].append(time.perf_counter() - start)
    return times


def resident_mb(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process, in MB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**10
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_resident() -> None:
    # Writing 5 to clear_refs resets the peak resident set size (Linux >= 4.0), so the
    # peak excludes the transient memory of loading the model.
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def measure_memory(args: argparse.Namespace) -> dict[str, float]:
    """Peak memory of warm-up plus timed steps of one method (run in its own process)."""
    tokenizer, step = make_step(args.memory_of, args)
    batch = make_batch(args, tokenizer)
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak_resident()
        before = resident_mb("VmRSS")
    for _ in range(args.warmup + args.steps):
        step(batch)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resident_mb("VmHWM")
    return {"before_mb": before, "peak_mb": peak}


def memory_in_subprocess(method: str) -> dict[str, float]:
    command = [sys.executable, *sys.argv, "--memory-of", method]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    logging.set_verbosity_error()
    if args.memory_of:
        print(json.dumps(measure_memory(args)))
        return
    print(
        f"MiniLM-L6 + LoRA r={args.rank} (query, value) + head, batch {args.batch_size} x "
        f"{args.max_length} tokens of IMDB, {args.device}, {torch.get_num_threads()} threads"
    )
    times = time_steps(args)
    median = {method: statistics.median(values) for method, values in times.items()}
    for method in METHODS:
        print(f"  {method:5s} step: median {1e3 * median[method]:8.1f} ms over {args.steps} steps")
    print(f"time ratio   BLoB / LoRA: {median['blob'] / median['lora']:.3f}   (target <= 1.20)")
    memory = {method: memory_in_subprocess(method) for method in METHODS}
    unit = "allocated" if args.device.startswith("cuda") else "resident"
    for method in METHODS:
        m = memory[method]
        print(
            f"  {method:5s} peak {unit} {m['peak_mb']:8.1f} MB, "
            f"{m['peak_mb'] - m['before_mb']:8.1f} MB above the model before the first step"
        )
    total = memory["blob"]["peak_mb"] / memory["lora"]["peak_mb"]
    working = (memory["blob"]["peak_mb"] - memory["blob"]["before_mb"]) / (
        memory["lora"]["peak_mb"] - memory["lora"]["before_mb"]
    )
    print(f"memory ratio BLoB / LoRA: {total:.3f} of the peak, {working:.3f} of the step's own")
    print("                          (target <= 1.15)")


if __name__ == "__main__":
    main()
