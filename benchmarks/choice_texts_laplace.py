"""Laplace-LoRA on a multiple-choice causal LM scored by its choices' texts: one backward
pass per batch where the columns would take one per class.

:class:`~pyro_bdl.models.ChoiceTexts` runs each of the ``C`` choices through the LM on its
own, so each recorded linear call feeds one choice's score. The GGN's ``C - 1`` columns
(and the linearised predictive's ``C`` unit columns) then need one backward pass of the
scores, scaled per choice (:meth:`~pyro_bdl.inference.laplace.jacobians.Linearization.
_separable_backward`), instead of one pass per column through every choice's sequences.
Measured side by side in one run, on a Llama from its config (the cost depends on
shapes): a K-FAC fit (``map=`` given values) and the GLM predictive (link ``"mc"``) over
the same batches, with the one-pass path and with it switched off
(``MAX_SEPARABLE_ENTRIES = 0``), each the least time over rounds run in turn; and the
largest differences between the two (Llama's RMSNorm computes in float32, so they agree
to float32's precision, not float64's).

Run: ``python benchmarks/choice_texts_laplace.py [--rounds 3] [--batches 4] [--threads 1]``
"""

from __future__ import annotations

import argparse
import time

import pyro
import torch
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

import pyro_bdl as bdl
from pyro_bdl.inference import LaplaceGuide
from pyro_bdl.inference.laplace import jacobians
from pyro_bdl.models import BayesianNet, ChoiceTexts, lora_model
from pyro_bdl.priors import IIDNormal

CHOICES, BATCH, PROMPT, ANSWER = 4, 8, 48, 8


def batches(count: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    """``count`` batches of ``BATCH`` questions, each choice a prompt and its own text."""
    generator = torch.Generator().manual_seed(0)
    shape = (BATCH, CHOICES, PROMPT + ANSWER)
    result = []
    for _ in range(count):
        ids = torch.randint(3, vocab, shape, generator=generator)
        choice_tokens = torch.full_like(ids, -100)
        choice_tokens[..., -ANSWER:] = ids[..., -ANSWER:]
        labels = torch.randint(0, CHOICES, (BATCH,), generator=generator)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        result.append({**batch, "choice_tokens": choice_tokens, "labels": labels})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=128,
    )
    lora = lora_model(LlamaForCausalLM(config), "causal_lm")
    net = bdl.lift(ChoiceTexts(lora.peft_model), IIDNormal(0.2), random="lora_")
    model = BayesianNet(net)
    data = batches(args.batches, config.vocab_size)
    loader = DataLoader(data, batch_size=None)
    num_data = BATCH * args.batches
    trace = pyro.poutine.trace(model).get_trace(data[0], num_data)
    # a fine-tuned-like point: LoRA's B away from zero, so that every call has a gradient
    values = {
        name: 0.02 * torch.randn_like(trace.nodes[name]["value"]) for name in net.random_sites
    }

    def laplace(one_pass: bool):
        jacobians.MAX_SEPARABLE_ENTRIES = 16 if one_pass else 0
        guide = LaplaceGuide(model, curvature="kron")
        start = time.perf_counter()
        guide.fit(loader, num_data, map=values, progress=False)
        fitted = time.perf_counter()
        with torch.no_grad():
            pyro.set_rng_seed(0)
            probs = torch.cat([guide.predictive(b, num_data, link="mc") for b in data])
        predicted = time.perf_counter()
        return fitted - start, predicted - fitted, guide, probs

    def epoch() -> float:
        weights = {name: value.clone().requires_grad_() for name, value in values.items()}
        start = time.perf_counter()
        for batch in data:
            pyro.poutine.trace(pyro.poutine.condition(model, weights)).get_trace(
                batch, num_data
            ).log_prob_sum().backward()
        return time.perf_counter() - start

    best = {"epoch": float("inf"), True: (float("inf"),) * 2, False: (float("inf"),) * 2}
    found = {}
    for _ in range(args.rounds):
        best["epoch"] = min(best["epoch"], epoch())
        for one_pass in (True, False):
            fit_s, predict_s, guide, probs = laplace(one_pass)
            best[one_pass] = tuple(map(min, zip(best[one_pass], (fit_s, predict_s))))
            found[one_pass] = (guide, probs)
    (fast_fit, fast_predict), (slow_fit, slow_predict) = best[True], best[False]
    factors = [
        max(
            float((a - b).abs().max() / b.abs().max())
            for (name, a), b in zip(fast.tensors().items(), slow.tensors().values())
            if name.endswith("eigenvalues")  # eigenvectors of close eigenvalues may turn
        )
        for fast, slow in zip(found[True][0].laplace_fit.blocks, found[False][0].laplace_fit.blocks)
    ]
    print(
        f"ChoiceTexts on a Llama (hidden {config.hidden_size}, {config.num_hidden_layers} "
        f"layers), {args.batches} batches of {BATCH} questions x {CHOICES} choices x "
        f"{PROMPT + ANSWER} tokens, {args.threads} thread(s), best of {args.rounds}"
    )
    print(f"epoch of forward+backward   {best['epoch']:.2f} s")
    print(
        f"K-FAC fit          one pass {fast_fit:.2f} s, per column {slow_fit:.2f} s, "
        f"ratio {fast_fit / slow_fit:.2f}; {fast_fit / best['epoch']:.2f} epochs"
    )
    print(
        f"GLM predictive     one pass {fast_predict:.2f} s, per column {slow_predict:.2f} s, "
        f"ratio {fast_predict / slow_predict:.2f}"
    )
    probs_gap = float((found[True][1] - found[False][1]).abs().max())
    print(
        f"largest difference: K-FAC eigenvalues {max(factors):.1e} (of the largest), "
        f"predictive probabilities {probs_gap:.1e}"
    )


if __name__ == "__main__":
    main()
