"""What keeping a K-FAC Laplace-LoRA posterior costs: save and load time, and bytes.

Measured side by side in one run, MiniLM + LoRA (r 8 on query/value, a random 2-class
head; synthetic batches of 32 x 64 tokens: the cost depends on shapes, not words):

* the fit (``LaplaceGuide(..., "kron").fit(map=False)``: one curvature pass, with the
  gradient for its mode check, saved too, and the eigendecompositions that check needs);
* ``bdl.save`` and ``bdl.load`` (in this process: reading the files, one forward of the
  model on zeros to rebuild and check its sites, the state set), each the least of
  ``--rounds`` runs. Target: load under 2 % of the fit.
* the directory's bytes against the factors' own (the eigendecompositions the guide holds
  in memory, each shared factor once). Target: within 1.5x.
* what verifying costs: ``bdl.load`` hashes every file (SHA-256) before reading it; the
  hash of a file of the 7B posterior's size (random bytes, the least of ``--rounds``,
  read from the page cache as a load right after a copy reads it), and its share of the
  MiniLM load.

The 7B size is arithmetic, never built: Llama-2-7B (32 layers, width 4096) with LoRA
r 8 on q_proj and v_proj, under ``Kron``'s defaults (a factor wider than ``max_dense =
1024`` kept at rank ``64``), counted by the rules that give the MiniLM numbers, which the
script checks against the measured file first.

Run: ``python benchmarks/persistence.py [--batches 64] [--rounds 3] [--threads 1]``
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import pyro_bdl as bdl
from pyro_bdl.inference import LaplaceGuide
from pyro_bdl.inference.laplace.serialization import laplace_state
from pyro_bdl.persistence import _sha256

BATCH, LENGTH = 32, 64


def token_batches(num_batches: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(1000, vocab, (BATCH, LENGTH), generator=generator),
            "attention_mask": torch.ones(BATCH, LENGTH, dtype=torch.long),
            "labels": torch.randint(0, 2, (BATCH,), generator=generator),
        }
        for _ in range(num_batches)
    ]


def timed(function) -> tuple[float, object]:
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def least(function, rounds: int) -> tuple[float, object]:
    runs = [timed(function) for _ in range(rounds)]
    return min(seconds for seconds, _ in runs), runs[-1][1]


def hash_seconds(size: int, rounds: int) -> float:
    """The least time of ``rounds`` SHA-256s of a ``size``-byte file (what load verifies)."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "posterior.safetensors"
        with path.open("wb") as handle:
            for start in range(0, size, 1 << 24):
                handle.write(os.urandom(min(1 << 24, size - start)))
        return least(lambda: _sha256(path), rounds)[0]


def factor_bytes(guide) -> int:
    """The bytes of the curvature the guide holds: every block tensor, shared ones once."""
    _, tensors = laplace_state(guide.laplace_fit, guide.sites)
    curvature = {k: v for k, v in tensors.items() if k.startswith(("factor/", "block/"))}
    return sum(value.numel() * value.element_size() for value in curvature.values())


def kron_numbers(width: int, layers: int, rank: int, head: int | None, max_dense: int, k: int):
    """Numbers a saved K-FAC LoRA posterior holds (q and v adapted, one head or none).

    Per layer: the hidden states A_q and A_v read (one shared factor), two r x r output
    factors of A, two r x r input factors of B, two width-sided output factors of B. A
    factor of side d is d x d + d as an eigendecomposition, or d x k + k if d > max_dense
    (sketched at rank k). The means and the gradient at them are two numbers per weight;
    an IID prior's mean and precision and a tuned prior precision one number per site.
    """

    def factor(d: int) -> int:
        return d * d + d if d <= max_dense else d * k + k

    curvature = layers * (factor(width) + 4 * factor(rank) + 2 * factor(width))
    weights = layers * 2 * (rank * width + width * rank)
    sites = layers * 4
    if head is not None:  # a new head: its weight's two factors, its bias's diagonal
        curvature += factor(width) + factor(head) + head
        weights += head * width + head
        sites += 2
    return {"curvature": curvature, "means": weights, "per-site": 3 * sites}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=64, help="batches of 32 x 64 tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    from pyro_bdl.models import lora_model

    lora = lora_model("minilm", "classification", num_labels=2)
    batches = token_batches(options.batches, lora.tokenizer.vocab_size)
    loader = DataLoader(batches, batch_size=None)  # the batches as they are
    num_data = BATCH * len(batches)
    guide = LaplaceGuide(lora.model, "kron")
    with warnings.catch_warnings():  # random tokens: the checkpoint is no mode of them
        warnings.simplefilter("ignore")
        fit, _ = timed(lambda: guide.fit(loader, num_data, map=False, progress=False))
    directory = Path(tempfile.mkdtemp()) / "posterior"
    save, _ = least(lambda: bdl.save(guide, directory), options.rounds)
    load, loaded = least(lambda: bdl.load(directory, lora.model), options.rounds)
    generator = torch.Generator().manual_seed(0)
    same = torch.equal(
        guide.predictive(batches[0], num_data, generator=generator),
        loaded.predictive(batches[0], num_data, generator=torch.Generator().manual_seed(0)),
    )
    files = {path.name: path.stat().st_size for path in directory.iterdir()}
    total, factors = sum(files.values()), factor_bytes(guide)

    print(f"MiniLM + LoRA r 8 (q, v) + head, K-FAC; {len(batches)} batches of {BATCH} x {LENGTH}")
    print(f"  fit (curvature pass)          {fit:8.2f} s")
    print(f"  bdl.save                      {save:8.3f} s   ({save / fit:.1%} of the fit)")
    print(f"  bdl.load                      {load:8.3f} s   ({load / fit:.2%} of the fit; "
          "target < 2 %)")  # fmt: skip
    print(f"  loaded predictive identical:  {same}")
    for name, size in sorted(files.items()):
        print(f"    {name:28s} {size / 1e6:9.3f} MB")
    print(f"  directory {total / 1e6:.2f} MB, the factors' own bytes {factors / 1e6:.2f} MB: "
          f"{total / factors:.2f}x (target <= 1.5x)")  # fmt: skip

    config = lora.peft_model.base_model.model.config
    minilm = kron_numbers(config.hidden_size, config.num_hidden_layers, 8, 2, 1024, 64)
    itemsize = torch.finfo(torch.float32).bits // 8
    print(f"  arithmetic for MiniLM: curvature {minilm['curvature'] * itemsize / 1e6:.3f} MB "
          f"(measured {factors / 1e6:.3f} MB)")  # fmt: skip
    llama = kron_numbers(4096, 32, 8, None, 1024, 64)
    print("Llama-2-7B + LoRA r 8 (q, v), K-FAC defaults (max_dense 1024, rank 64), float32, "
          "by arithmetic:")  # fmt: skip
    curvature, means = llama["curvature"] * itemsize, llama["means"] * itemsize
    saved = curvature + 2 * means + llama["per-site"] * itemsize  # the MAP and the gradient
    print(f"  factors {curvature / 1e6:.1f} MB, MAP {means / 1e6:.1f} MB; posterior.safetensors "
          f"{saved / 1e6:.1f} MB, with the peft adapter {(saved + means) / 1e6:.1f} MB "
          f"({(saved + means) / curvature:.2f}x the factors)")  # fmt: skip
    minilm_hash = sum(hash_seconds(size, options.rounds) for size in files.values())
    llama_bytes = int(saved + means)
    llama_hash = hash_seconds(llama_bytes, options.rounds)
    print(f"verifying (SHA-256 of every file at load): MiniLM {minilm_hash:.3f} s "
          f"({minilm_hash / load:.1%} of its load); the 7B posterior's {llama_bytes / 1e6:.1f} MB "
          f"{llama_hash:.3f} s ({llama_bytes / 1e6 / llama_hash:.0f} MB/s)")  # fmt: skip


if __name__ == "__main__":
    main()
