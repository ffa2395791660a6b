"""One IVON step against one AdamW step of plain peft LoRA: the time ratio.

The model is the "deep" CPU proxy of issue 11: a Llama-architecture causal LM with random
weights (24 layers, width 64, 4 heads, intermediate 128, vocabulary 1000), LoRA r 8 alpha
16 on q_proj / v_proj, a 4-answer multiple-choice likelihood on the label tokens at the
last position, batches of 4 x 32 tokens. The AdamW step is what peft alone does: forward
(last position only), mean cross entropy, backward, ``optimizer.step()``. The IVON step is
:meth:`pyro_bdl.inference.IVONSVI.step` on every LoRA weight (A and B random, as in
Cong et al. 2024): one weight draw, the Pyro model's forward and backward, the update.
The two are timed in interleaved rounds in one process, so that the machine's load
affects both alike, and the medians are compared. Target: <= 1.10 (IVON is "at the cost
of Adam": the update is a few element-wise passes over the LoRA weights).

:func:`ivon_step` is the IVON case for ``benchmarks/llm_scale.py``.

Run::

    python benchmarks/ivon_overhead.py                      # the deep proxy, CPU
    python benchmarks/ivon_overhead.py --threads 1 --rounds 15
    python benchmarks/ivon_overhead.py --device cuda --layers 32 --hidden 4096 --heads 32 \\
        --intermediate 11008 --vocab 32000 --length 256 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pyro_bdl.inference import IVONSVI, IVONGuide
from pyro_bdl.models import lora_model

LABEL_TOKENS = [10, 11, 12, 13]  # the tokens of " A", " B", " C", " D"
NUM_DATA = 10_000


def ivon_step(model: Callable, batch: dict, num_data: int, **settings) -> Callable[[], None]:
    """A function that takes one :class:`~pyro_bdl.inference.IVONSVI` step on ``batch``.

    The guide is set up by a first step here, so that every timed call is a steady step.

    :param callable model: the Pyro model ``model(batch, num_data)``.
    :param dict batch: one minibatch.
    :param int num_data: the training-set size N.
    :param settings: :class:`~pyro_bdl.inference.IVONSVI`'s options (default lr 1e-6, so
        that repeated steps on one batch leave the weights near where they started).
    """
    svi = IVONSVI(model, IVONGuide(model), **{"lr": 1e-6, **settings})
    svi.step(batch, num_data)

    def step() -> None:
        svi.step(batch, num_data)

    return step


def adamw_step(peft_model: torch.nn.Module, batch: dict) -> Callable[[], None]:
    """A function that takes one plain peft LoRA AdamW step on ``batch`` (no Pyro)."""
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-6, eps=1e-6)
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    inputs["position_ids"] = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)

    def step() -> None:
        logits = peft_model(**inputs, use_cache=False, logits_to_keep=1).logits
        loss = F.cross_entropy(logits[:, -1, LABEL_TOKENS].float(), batch["labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def build(args: argparse.Namespace):
    """The LoRA Llama (A and B random) and one batch of random prompts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
        max_position_embeddings=4096,
    )
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        base = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    base.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lora = lora_model(
            base,
            "multiple_choice",
            label_token_ids=LABEL_TOKENS,
            rank=8,
            alpha=16,
            dropout=0.0,
            target_modules=["q_proj", "v_proj"],
            head="frozen",
        )
    for name, param in lora.peft_model.named_parameters():
        if "lora_B" in name:  # a fine-tuned checkpoint has B != 0
            torch.nn.init.normal_(param, std=0.02)
    generator = torch.Generator().manual_seed(args.seed)
    batch = {
        "input_ids": torch.randint(
            100, args.vocab, (args.batch_size, args.length), generator=generator
        ),
        "attention_mask": torch.ones(args.batch_size, args.length, dtype=torch.long),
        "labels": torch.randint(0, len(LABEL_TOKENS), (args.batch_size,), generator=generator),
    }
    return lora, {key: value.to(args.device) for key, value in batch.items()}


def measure(steps: dict[str, Callable[[], None]], rounds: int, device: str) -> dict[str, float]:
    """Median seconds per call of each step, timed in interleaved rounds (order alternating)."""
    names = list(steps)
    for name in names:  # warm-up: allocator, optimiser state
        steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            steps[name]()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=21, help="interleaved timing rounds")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lora, batch = build(args)
    steps = {
        "adamw": adamw_step(lora.peft_model, batch),
        "ivon": ivon_step(lora.model, batch, NUM_DATA),
    }
    seconds = measure(steps, args.rounds, args.device)
    weights = sum(p.numel() for p in lora.peft_model.parameters() if p.requires_grad)
    print(
        f"Llama ({args.layers} layers, width {args.hidden}), LoRA r 8 on q_proj/v_proj "
        f"({weights} weights), batch {args.batch_size} x {args.length}, {args.device} "
        f"{args.dtype}, {torch.get_num_threads()} threads, {args.rounds} rounds"
    )
    print(f"  AdamW step (peft)   {seconds['adamw'] * 1e3:8.1f} ms")
    print(f"  IVON step (IVONSVI) {seconds['ivon'] * 1e3:8.1f} ms")
    print(f"  IVON / AdamW        {seconds['ivon'] / seconds['adamw']:8.3f}   (target <= 1.10)")


if __name__ == "__main__":
    main()
