"""Parallel SGHMC chains and a deep ensemble across the processes of a torchrun job.

Chain ``c`` runs on rank ``c mod W`` (each rank on its own GPU when there are GPUs),
writes its draws to a chunked store under ``--out``, and rank 0 gathers every chain,
exports them to ArviZ and checks convergence. The same launcher then trains a deep
ensemble: SGHMC at temperature 0, one member per chain, each from its own random start.

Run::

    # two processes on this machine's CPU (what CI runs, with --quick)
    torchrun --standalone --nproc_per_node=2 examples/distributed_chains.py --quick
    # one process per GPU of this machine
    torchrun --standalone --nproc_per_node=gpu examples/distributed_chains.py
    # two machines of 8 GPUs: run this on each, with the first machine's address
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:29500 examples/distributed_chains.py --out /shared/run
    # without torchrun it is one process running every chain in turn
    python examples/distributed_chains.py --quick
"""

import argparse
from pathlib import Path

import pyro.distributions as dist
import torch
from pyro.infer.autoguide.initialization import init_to_sample

import pyro_bdl as bdl
from pyro_bdl.inference import SGHMC, Chains
from pyro_bdl.predict import predict_proba


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps (the CI smoke test)")
    parser.add_argument("--num-chains", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("results/distributed_chains"))
    return parser.parse_args()


def two_moons(num: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two interleaved half circles with noise: a small non-linear classification task."""
    labels = torch.randint(0, 2, (num,), generator=generator)
    angle = torch.rand(num, generator=generator) * torch.pi
    x = torch.stack([angle.cos() - labels, angle.sin() * (1 - 2 * labels) + 0.5 * labels], -1)
    return x + 0.1 * torch.randn(num, 2, generator=generator), labels


def main() -> None:
    args = parse_args()
    args.out = args.out / ("quick" if args.quick else "full")  # a rerun resumes its own run
    bdl.distributed.init_process_group()  # joins the torchrun job; nothing without torchrun
    rank, world, device = (
        bdl.distributed.rank(),
        bdl.distributed.world_size(),
        bdl.distributed.device(),
    )
    generator = torch.Generator().manual_seed(0)
    train_x, train_y = two_moons(512, generator)
    test_x, test_y = two_moons(256, generator)

    torch.manual_seed(0)  # the same network on every rank
    mlp = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    net = bdl.lift(mlp.to(device), prior=bdl.priors.IIDNormal(scale=1.0))

    def model(batch, num_data):
        x, y = batch
        logits = net(x.to(device))
        y = None if y is None else y.to(device)
        bdl.observe("y", dist.Categorical(logits=logits), obs=y, num_data=num_data)
        return logits

    def accuracy(samples: dict) -> float:
        probs = predict_proba(model, (test_x, None), len(train_x), samples=samples)
        return float((probs.mean(0).argmax(-1).cpu() == test_y).float().mean())

    # each chain's order comes from its seed, on whichever rank it runs
    loader = bdl.data.TensorLoader((train_x, train_y), batch_size=64, shuffle=True)
    warmup, num_samples = (20, 10) if args.quick else (2000, 200)

    # Bayesian posterior: chain c on rank c mod W, its draws streamed to out/chains/chain_c.
    kernel = SGHMC(model, step_size=0.05, temperature=1.0, thin=2, checkpoint=args.out / "chains")
    chains = Chains(kernel, num_samples, warmup, num_chains=args.num_chains, seed=0)
    chains.run(loader, len(train_x))
    print(f"rank {rank} of {world} on {device}: holds chains {chains.chain_ids}")
    if rank == 0:
        samples = chains.get_samples()
        summary = bdl.diagnostics.summary(bdl.to_arviz(chains))
        worst = max(float(summary[name].sel(summary="r_hat").max()) for name in summary)
        print(f"posterior: {len(samples['0.weight'])} draws, test accuracy {accuracy(samples):.3f}")
        print(f"largest R-hat over all weights: {worst:.3f}")
        stores = args.out / "chains"
        if len(list(stores.glob("chain_*"))) == args.num_chains:
            # every chain's store is here (one machine, or a shared file system): open them
            # lazily, merged by chain, as one would a run too large for memory
            stored = bdl.to_arviz(stores)
            print(f"stores under {stores}: {dict(stored['posterior'].sizes)}")

    # Deep ensemble: SGHMC at temperature 0 is SGD with momentum; one member per chain,
    # each from its own draw of the prior, keeping its last iterate.
    member = SGHMC(model, step_size=0.05, temperature=0.0)
    ensemble = Chains(
        member,
        num_samples=1,
        warmup_steps=warmup * 2,
        num_chains=args.num_chains,
        init_params=lambda chain: init_to_sample,
        seed=100,
    )
    ensemble.run(loader, len(train_x))
    if rank == 0:
        members = ensemble.get_samples()
        print(f"deep ensemble of {args.num_chains}: test accuracy {accuracy(members):.3f}")


if __name__ == "__main__":
    main()
