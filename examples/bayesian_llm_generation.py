"""Generate text from a Bayesian language model and read its uncertainty token by token.

A causal LM with LoRA adapters whose weights have a posterior, here the draws of four
SGHMC chains at temperature 1 (parallel SGHMC, a Bayesian deep ensemble), decodes from the
Bayesian model average of its next-token distributions (``pyro_bdl.lm.generate``), and
each generated token comes with its total (TU), aleatoric (AU) and epistemic (EU)
uncertainty in nats: EU is where the draws disagree, which text unlike the fine-tuning
data brings out. The script:

1. builds the base: a local Hugging Face causal LM (``--model PATH``) or, by default, a
   small byte-level Llama trained here on a book for a minute (nothing is downloaded);
2. runs four SGHMC chains on the LoRA adapters of its attention layers, fine-tuning on
   English sentences (FLORES-200 ``dev``);
3. scores an English and a Samoan prompt token by token (``pyro_bdl.lm.token_uncertainty``:
   the Samoan one, unlike the fine-tuning data, should carry more EU), samples a
   continuation of each from the model average, prints every new token with its TU, AU
   and EU, and plots them (``generation.png``); ``results.json`` keeps the text and the
   numbers.

    python examples/bayesian_llm_generation.py --data-dir ../shared/data --out results/gen

About a minute and a half of one CPU core; ``--quick`` runs in seconds (and its model is too
small to say anything).
"""

import argparse
import json
import warnings
from pathlib import Path

import pyro
import torch
from matplotlib.figure import Figure
from peft.tuners.lora import LoraLayer
from transformers import LlamaConfig, LlamaForCausalLM

import pyro_bdl as bdl
from pyro_bdl import data, lm
from pyro_bdl.inference import SGHMC, Chains, fit_map
from pyro_bdl.models import BayesianNet, NextToken, lora_model

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--data-dir", default="../shared/data", help="holds books/ and flores/")
parser.add_argument("--out", default="results/bayesian_llm_generation")
parser.add_argument("--model", help="a local Hugging Face causal LM (default: train a small one)")
parser.add_argument("--quick", action="store_true", help="seconds, for CI")
args = parser.parse_args()
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
pyro.set_rng_seed(0)
base_steps, sentences, epochs, new_tokens = (3, 32, 1, 8) if args.quick else (1000, 600, 4, 40)
PROMPTS = {
    "English": "The scientists said that the new results",
    "Samoan": "Na faapea mai le au saienitisi o faaiuga fou",
}


class Bytes:
    """UTF-8 bytes as token ids (256 of them, plus an end-of-text id): no vocabulary to learn."""

    eos_token_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def windows(ids: list[int], length: int = 64) -> list[torch.Tensor]:
    ids = torch.tensor(ids)
    return list(ids[: len(ids) // length * length].view(-1, length))


def collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right-padded rows; labels -100 at the padding (the model shifts them)."""
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


# -- 1. the base model -------------------------------------------------------------------------
if args.model:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
else:
    tokenizer = Bytes()
    config = LlamaConfig(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        eos_token_id=Bytes.eos_token_id,
    )
    base = LlamaForCausalLM(config)
    book = data.load("books", args.data_dir, "train", book="1342")[0]["text"][:400_000]
    pretraining = windows(tokenizer.encode(book))
    loader = torch.utils.data.DataLoader(pretraining, 16, shuffle=True, collate_fn=collate)
    whole = bdl.lift(base, prior=bdl.priors.IIDNormal(100.0))  # every weight, a flat prior
    values = fit_map(
        BayesianNet(whole, NextToken()),
        loader,
        len(pretraining),
        num_steps=base_steps,
        optimizer=pyro.optim.AdamW({"lr": 3e-3}),
        mle=True,
    )
    with torch.no_grad():
        for site, value in values.items():
            whole.parameter(site).copy_(value)
    pyro.clear_param_store()

# -- 2. LoRA adapters with a prior, and four SGHMC chains on English sentences -----------------
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    lora = lora_model(base, "causal_lm", rank=8, alpha=32, dropout=0.0, prior_scale=0.2)
english = data.load("flores", args.data_dir, "dev", language="eng_Latn")[:sentences]
train = [torch.tensor(tokenizer.encode(r["text"])[:96]) for r in english]
loader = torch.utils.data.DataLoader(train, 16, shuffle=True, collate_fn=collate)


def fresh_adapters(chain: int) -> dict:
    """peft's initialisation (A random, B = 0: the base model) from the chain's own seed."""
    torch.manual_seed(chain)
    for layer in lora.peft_model.modules():
        if isinstance(layer, LoraLayer):
            layer.reset_lora_parameters("default", True)
    return lora.net.init_values()


# step size eps and friction alpha: at T = 0 this is SGD with momentum 1 - eps alpha = 0.9 and
# learning rate eps / alpha = 1e-3 on the per-sentence loss; T = 1 samples the posterior
chains = Chains(
    SGHMC(
        lora.model,
        step_size=0.01,
        friction=10.0,
        temperature=1.0,
        adapt_step_size=False,  # the fixed step of the recorded run
        adapt_mass_matrix=False,
    ),
    num_samples=1,
    warmup_steps=epochs * len(loader) - 1,
    num_chains=4,
    init_params=fresh_adapters,
    seed=0,
)
chains.run(loader, len(train))
samples = chains.get_samples()  # site -> (4, *shape): the last draw of each chain

# -- 3. generate from the model average, with the uncertainty of every token -------------------
results = {}
figure = Figure(figsize=(11, 5.5), dpi=110, layout="constrained")
axes = figure.subplots(len(PROMPTS), 1)
for ax, (language, prompt) in zip(axes, PROMPTS.items()):
    ids = torch.tensor([tokenizer.encode(prompt)])
    # sampled from the model average at temperature 0.7 (do_sample=False: greedy)
    output = lm.generate(
        lora.model,
        ids,
        samples=samples,
        max_new_tokens=new_tokens,
        do_sample=True,
        temperature=0.7,
        generator=torch.Generator().manual_seed(0),
    )
    new = output.sequences[0, ids.shape[1] :].tolist()
    tokens = [tokenizer.decode([token]) for token in new]
    scores = {name: value[0].tolist() for name, value in output.uncertainty._asdict().items()}
    # the prompt itself, scored token by token: text unlike the fine-tuning data
    prompt_scores = lm.token_uncertainty(
        lora.model, {"input_ids": ids}, len(train), samples=samples
    )
    reading = {name: float(value[0].nanmean()) for name, value in prompt_scores._asdict().items()}
    print(
        f"\n{language} prompt, mean per token: TU {reading['total']:.3f}, "
        f"EU {reading['epistemic']:.3f}, loss {reading['nll']:.3f} nats"
    )
    print(f"{language}: {prompt!r} -> {tokenizer.decode(new)!r}")
    print(f"{'token':>8} {'TU':>6} {'AU':>6} {'EU':>6}")
    for i, token in enumerate(tokens):
        tu, au, eu = (scores[name][i] for name in ("total", "aleatoric", "epistemic"))
        print(f"{token!r:>8} {tu:6.3f} {au:6.3f} {eu:6.3f}")
    results[language] = {
        "prompt": prompt,
        "prompt_mean": reading,
        "continuation": tokenizer.decode(new),
        **scores,
    }
    steps = range(len(tokens))
    ax.bar(steps, scores["aleatoric"], label="aleatoric (AU)", color="tab:blue")
    ax.bar(steps, scores["epistemic"], bottom=scores["aleatoric"], label="epistemic (EU)",
           color="tab:red")  # fmt: skip
    ax.set_xticks(list(steps), [repr(t)[1:-1].replace(" ", "␣") for t in tokens], fontsize=7)
    mean_eu = sum(scores["epistemic"]) / len(tokens)
    ax.set(
        ylabel="nats",
        title=f"{language}: {prompt!r} (mean EU: prompt {reading['epistemic']:.3f}, "
        f"generated {mean_eu:.3f})",
    )
axes[0].legend(fontsize="small")
figure.suptitle("Per-token uncertainty of generated text: TU = AU + EU (parallel SGHMC, 4 draws)")
figure.savefig(out / "generation.png")
(out / "results.json").write_text(json.dumps(results, indent=1))
print(f"\nwrote {out / 'generation.png'} and {out / 'results.json'}")
