"""Large models on one GPU: CUDA, bf16 bases, checkpointing, quantised bases.

The tests that need a GPU (or bitsandbytes) run where one is present and skip elsewhere;
what runs on a CPU runs everywhere.
"""

import importlib.util

import pyro
import pytest
import torch
from pyro.infer import TraceMeanField_ELBO
from torch.utils.data import DataLoader

from pyro_bdl.inference import BLoBGuide, BLoBSVI, LaplaceGuide
from pyro_bdl.models import lora_model

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BITSANDBYTES = importlib.util.find_spec("bitsandbytes") is not None
LABELS = [3, 4, 5, 6]


def _batches(device="cpu", num_batches=2, batch_size=4, length=7, vocab=48):
    generator = torch.Generator().manual_seed(0)
    rows = [
        {
            "input_ids": torch.randint(7, vocab, (length,), generator=generator),
            "attention_mask": torch.ones(length, dtype=torch.long),
            "labels": torch.randint(0, len(LABELS), (), generator=generator),
        }
        for _ in range(num_batches * batch_size)
    ]

    def collate(rows):
        return {key: torch.stack([row[key] for row in rows]).to(device) for key in rows[0]}

    return DataLoader(rows, batch_size=batch_size, collate_fn=collate)


def _multiple_choice(base, **options):
    lora = lora_model(base, "multiple_choice", label_token_ids=LABELS, dropout=0.0, **options)
    for name, param in lora.peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return lora


@pytest.mark.skipif(BITSANDBYTES, reason="bitsandbytes is installed")
def test_quantised_bases_without_bitsandbytes_are_a_named_error(tiny_llama, tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    with pytest.raises(ImportError, match="bitsandbytes"):
        lora_model(tmp_path, "multiple_choice", label_token_ids=LABELS, quantization="4bit")


@CUDA
@pytest.mark.skipif(not BITSANDBYTES, reason="needs bitsandbytes")
@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_quantised_bases_fit_blob_and_kron_on_cuda(tiny_llama, tmp_path, quantization):
    tiny_llama(dtype=torch.float32).save_pretrained(tmp_path)
    lora = _multiple_choice(tmp_path, quantization=quantization, device_map={"": 0})
    assert all(
        p.dtype == torch.float32 for n, p in lora.peft_model.named_parameters() if "lora_" in n
    )
    loader = _batches("cuda")
    guide = LaplaceGuide(lora.model, curvature="kron").fit(
        loader, 100, map=False, progress=False, mode_tolerance=None
    )
    assert torch.isfinite(guide.log_marginal_likelihood())
    probs = guide.predictive(loader, 100, link="mc", num_samples=10)
    assert probs.is_cuda and torch.allclose(probs.sum(-1), torch.ones(8, device="cuda"))


@CUDA
def test_kron_fit_and_glm_predictive_on_cuda_equal_the_cpu_ones(tiny_llama):
    results = {}
    for device in ("cpu", "cuda"):
        lora = _multiple_choice(tiny_llama().to(device))
        guide = LaplaceGuide(lora.model, curvature="kron")
        guide.fit(_batches(device), 100, map=False, progress=False, mode_tolerance=None)
        _, covariance = guide.output_distribution(_batches(device), 100)
        results[device] = guide.log_marginal_likelihood().cpu(), covariance.cpu()
    torch.testing.assert_close(results["cuda"][0], results["cpu"][0], rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(results["cuda"][1], results["cpu"][1], rtol=1e-6, atol=1e-10)


@CUDA
def test_blob_steps_on_cuda_never_wait_for_the_device(tiny_llama):
    lora = _multiple_choice(tiny_llama(dtype=torch.float32).cuda(), adapters_random="A")
    guide = BLoBGuide(lora.model, prior_std=0.2)
    svi = BLoBSVI(lora.model, guide, num_steps=100, warmup_ratio=0.0)
    batch = next(iter(_batches("cuda")))
    svi.step(batch, 100)  # the first step validates the labels (one sync)
    torch.cuda.set_sync_debug_mode("error")  # any synchronising operation now raises
    try:
        records = [svi.step(batch, 100) for _ in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(record["nll"].is_cuda and record["kl"].is_cuda for record in records)
    assert all(torch.isfinite(record["nll"]) for record in records)


@CUDA
def test_bf16_base_with_float32_adapters_and_checkpointing_on_cuda(tiny_llama):
    gradients = []
    for checkpointing in (False, True):
        pyro.clear_param_store()
        base = tiny_llama(dtype=torch.bfloat16).cuda()
        lora = _multiple_choice(base, adapters_random="A", gradient_checkpointing=checkpointing)
        guide = BLoBGuide(lora.model, prior_std=0.2)
        batch = next(iter(_batches("cuda")))
        guide(batch, 100)
        ((loc, _),) = guide.flat_parameters()
        assert loc.dtype == torch.float32 and loc.is_cuda
        pyro.set_rng_seed(0)  # the same draw and flipout signs
        loss = TraceMeanField_ELBO().differentiable_loss(lora.model, guide, batch, 100)
        (gradient,) = torch.autograd.grad(loss, [loc])
        assert torch.isfinite(gradient).all() and gradient.abs().sum() > 0
        gradients.append(gradient)
    torch.testing.assert_close(gradients[0], gradients[1])


def test_draws_of_the_laplace_guide_stay_where_the_model_is(tiny_llama):
    # On a CPU this is the CPU; on a GPU the draws and the predictive stay on the GPU.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lora = _multiple_choice(tiny_llama().to(device))
    guide = LaplaceGuide(lora.model, curvature="kron")
    guide.fit(_batches(device), 100, map=False, progress=False, mode_tolerance=None)
    draws = guide.sample_posterior(3)
    assert all(draw.device.type == device for draw in draws.values())
