"""A BLoBTrainer and an IVONTrainer step against a plain Trainer LoRA step: time ratios.

Three ``transformers.Trainer`` runs of one Llama-architecture model with random weights
(``--size``, the shapes of ``benchmarks/llm_scale.py``: the ``wide`` and ``deep`` CPU
proxies, ``7b`` on a GPU), LoRA r 8 alpha 16 on q_proj / v_proj, next-token prediction on
random token windows, no dropout:

- ``Trainer``: the plain LoRA fine-tune (AdamW, the model's own loss);
- ``BLoBTrainer``: BLoB's step (flipout at the LoRA A projections, AdamW on the NLL, SGD
  on the re-weighted KL);
- ``IVONTrainer``: IVON's step (one weight draw, the IVON update of A, B).

A callback times each optimiser step of the Trainer's own loop, from ``on_step_begin`` to
``on_step_end`` (forward, backward, clipping, the update, the scheduler). The three
Trainers train in interleaved rounds of ``--steps`` steps (alternating order, so that the
machine's load affects them alike; the first round is warm-up), and each ratio is of the
medians. On CUDA the peak allocated memory of each Trainer's steps is printed beside.

Targets: BLoBTrainer / Trainer <= 1.15, IVONTrainer / Trainer <= 1.10.

Run::

    python benchmarks/trainer.py --size deep --threads 1       # the per-layer cost proxy
    python benchmarks/trainer.py --size wide --threads 1       # the large-matrix proxy
    python benchmarks/trainer.py --size 7b --device cuda       # bf16 base, a GPU
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import pyro
import torch
from llm_scale import SIZES  # the CPU proxies of issue 11 and the 7B shape
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging

from pyro_bdl.hf import BLoBTrainer, IVONTrainer

TRAINERS = {"Trainer": Trainer, "BLoBTrainer": BLoBTrainer, "IVONTrainer": IVONTrainer}
TARGETS = {"BLoBTrainer": 1.15, "IVONTrainer": 1.10}


class StepTimes(TrainerCallback):
    """The wall time of each optimiser step of the Trainer's loop (and peak CUDA memory)."""

    def __init__(self, device: torch.device):
        self.device, self.times, self.peak = device, [], 0

    def on_step_begin(self, args, state, control, **kwargs):
        synchronize(self.device)
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        synchronize(self.device)
        self.times.append(time.perf_counter() - self.start)
        if self.device.type == "cuda":
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peft_model(args: argparse.Namespace, size: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**size["model"], max_position_embeddings=4096)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        base = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(base, lora)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # as a fine-tune's: B != 0, so that A's gradient is not zero
            torch.nn.init.normal_(param, std=0.02)
    return model


def windows(size: dict, vocab: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    count = size["batches"] * size["batch_size"]
    tokens = torch.randint(100, vocab, (count, size["length"]), generator=generator)
    return [{"input_ids": t, "attention_mask": torch.ones_like(t), "labels": t} for t in tokens]


def trainers(args: argparse.Namespace, size: dict, out: str) -> dict[str, tuple]:
    data = windows(size, size["model"]["vocab_size"], args.seed)
    device = torch.device(args.device)
    made = {}
    for name, trainer_class in TRAINERS.items():
        pyro.clear_param_store()
        timer = StepTimes(device)
        arguments = TrainingArguments(
            f"{out}/{name}",
            per_device_train_batch_size=size["batch_size"],
            max_steps=args.steps,
            learning_rate=1e-6,  # repeated rounds stay near where they started
            bf16=args.dtype == "bfloat16" and device.type == "cuda",
            use_cpu=device.type == "cpu",
            save_strategy="no",
            logging_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=args.seed,
        )
        model = peft_model(args, size)
        settings = {"flipout": False} if trainer_class is BLoBTrainer and args.no_flipout else {}
        made[name] = (
            trainer_class(
                model=model, args=arguments, train_dataset=data, callbacks=[timer], **settings
            ),
            timer,
        )
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="deep")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds (1 warm-up)")
    parser.add_argument("--steps", type=int, default=4, help="steps per Trainer per round")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--no-flipout", action="store_true", help="BLoB without flipout")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    size = SIZES[args.size]
    print(
        f"Llama {args.size} ({size['model']['num_hidden_layers']} layers, width "
        f"{size['model']['hidden_size']}), LoRA r 8 on q_proj/v_proj, batches of "
        f"{size['batch_size']} x {size['length']} tokens, {args.device} {args.dtype}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    with tempfile.TemporaryDirectory() as out:
        made = trainers(args, size, out)
        names = list(made)
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                trainer, timer = made[name]
                if round_ == 0:  # warm-up: set-up, the guides' first calls
                    trainer.train()
                    timer.times.clear()
                    continue
                trainer.train()
    median = {name: statistics.median(timer.times) for name, (_, timer) in made.items()}
    for name, (_, timer) in made.items():
        memory = f", peak {timer.peak / 2**30:.2f} GiB allocated" if timer.peak else ""
        steps = len(timer.times)
        print(f"  {name:12s} step: median {1e3 * median[name]:9.1f} ms over {steps}{memory}")
    for name, target in TARGETS.items():
        ratio = median[name] / median["Trainer"]
        verdict = "met" if ratio <= target else "missed"
        print(f"time ratio {name} / Trainer: {ratio:.3f}   (target <= {target:.2f}, {verdict})")


if __name__ == "__main__":
    main()
