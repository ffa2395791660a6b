"""Kronecker factors: deferred, batched eigendecompositions and the streaming Nystrom sketch."""

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import pyro_bdl as bdl
from pyro_bdl.inference import Kron, LaplaceGuide
from pyro_bdl.inference.laplace.curvature.factors import (
    DenseFactor,
    Eigensolver,
    SketchFactor,
    nystrom,
)


def psd_rows(num_rows, dim, rank=None, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rank = rank or dim
    return torch.randn(num_rows, rank, generator=generator) @ torch.randn(
        rank, dim, generator=generator
    )


def test_batched_deferred_eigendecompositions_equal_dense_ones_one_by_one():
    solver, eigens, matrices = Eigensolver(), [], []
    for seed, dim in enumerate([5, 7, 5, 5, 7]):  # two sizes: two stacks
        factor = DenseFactor(dim, torch.zeros(()))
        for batch in psd_rows(12, dim, seed=seed).split(5):
            factor.update(batch)
        matrices.append(factor.sum.clone() * 0.5)
        eigens.append(factor.eigen(solver, 0.5))
    calls = {"eigh": 0, "eigvalsh": 0}
    eigh, eigvalsh = torch.linalg.eigh, torch.linalg.eigvalsh

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return call

    torch.linalg.eigh, torch.linalg.eigvalsh = counted("eigh", eigh), counted("eigvalsh", eigvalsh)
    try:
        values = [eigen.values for eigen in eigens]  # eigenvalues only, all factors at once
        assert calls == {"eigh": 0, "eigvalsh": 2}
        vectors = [eigen.vectors for eigen in eigens]
        assert calls == {"eigh": 2, "eigvalsh": 2}
        [eigen.vectors for eigen in eigens]  # cached
        assert calls == {"eigh": 2, "eigvalsh": 2}
    finally:
        torch.linalg.eigh, torch.linalg.eigvalsh = eigh, eigvalsh
    for matrix, value, vector, eigen in zip(matrices, values, vectors, eigens):
        torch.testing.assert_close(value, eigvalsh(matrix))
        torch.testing.assert_close(vector @ torch.diag(eigen.values) @ vector.T, matrix)
        assert eigen.matrix is None  # the sum is released once the vectors are known


def test_a_fit_decomposes_nothing_until_asked(helpers):
    network = helpers.mlp(bias=False)
    x, y = helpers.classification_data()
    net = bdl.lift(network, prior=bdl.priors.IIDNormal(1.0))
    guide = LaplaceGuide(helpers.classifier(net), curvature="kron")
    eigh, eigvalsh = torch.linalg.eigh, torch.linalg.eigvalsh
    used = []

    def recording(name, function):
        def call(matrix, *args, **kwargs):
            if matrix.shape[-1] > 3:  # not the 3 x 3 Hessians of the likelihood
                used.append(name)
            return function(matrix, *args, **kwargs)

        return call

    torch.linalg.eigh = recording("eigh", eigh)
    torch.linalg.eigvalsh = recording("eigvalsh", eigvalsh)
    try:
        loader = DataLoader(TensorDataset(x, y), batch_size=20)
        # the curvature pass alone (the mode check needs P^-1 g, eigenvectors included)
        guide.fit(loader, len(x), map=False, progress=False, mode_tolerance=None)
        assert used == []
        guide.log_marginal_likelihood()
        assert set(used) == {"eigvalsh"}
        guide.sample_posterior(2)
        assert "eigh" in used
    finally:
        torch.linalg.eigh, torch.linalg.eigvalsh = eigh, eigvalsh


def test_the_sketch_recovers_a_low_rank_factor_exactly():
    dim, rank = 40, 4
    rows = psd_rows(60, dim, rank=3, seed=1)  # the factor has rank 3 <= k
    sketch = SketchFactor(dim, torch.zeros(()), rank)
    for batch in rows.split(7):
        sketch.update(batch)
    vectors, values = nystrom(sketch.sketch, sketch.test, rank)
    torch.testing.assert_close(
        vectors @ torch.diag(values) @ vectors.T, rows.T @ rows, rtol=1e-9, atol=1e-9
    )
    assert vectors.shape == (dim, rank) and sketch.numel() == 2 * dim * (2 * rank + 8)


def test_the_sketch_is_within_its_error_bound_on_a_general_factor():
    # Tropp et al. (2017), Theorem 4.1: E ||F - F_k||_* <= (1 + k / (s - k - 1)) times the
    # best rank-k error ||F - [F]_k||_*. Averaged over 20 test matrices (each one's error
    # is at most a few times the bound), with 25% for the Monte Carlo error of the average.
    dim, rank = 60, 5
    size = 2 * rank + 8
    spectrum = 0.8 ** torch.arange(dim, dtype=torch.float64)
    basis = torch.linalg.qr(torch.randn(dim, dim, generator=torch.Generator().manual_seed(0)))[0]
    root = basis * spectrum.sqrt()  # F = root root^T, eigenvalues 0.8^i
    factor = root @ root.T
    best = spectrum[rank:].sum()
    errors = []
    for seed in range(20):
        sketch = SketchFactor(dim, torch.zeros(()), rank, seed=seed)
        for batch in root.T.split(16):  # rows whose Gram is F
            sketch.update(batch)
        vectors, values = nystrom(sketch.sketch, sketch.test, rank)
        residual = factor - vectors @ torch.diag(values) @ vectors.T
        errors.append(torch.linalg.matrix_norm(residual, "nuc"))
    bound = (1 + rank / (size - rank - 1)) * best
    assert torch.stack(errors).mean() <= 1.25 * bound
    assert min(errors) >= best * (1 - 1e-9)  # no rank-k matrix beats the best one


@pytest.mark.parametrize("data_rank, exact", [(2, True), (None, False)])
def test_factors_wider_than_max_dense_are_sketched(helpers, data_rank, exact):
    # A 30-wide input factor over max_dense=16 is sketched at rank 4, never formed densely.
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(50, data_rank or 30, generator=generator)
    if data_rank:
        x = x @ torch.randn(data_rank, 30, generator=generator)
    y = torch.randint(0, 3, (50,), generator=generator)
    torch.manual_seed(0)
    network = torch.nn.Sequential(torch.nn.Linear(30, 3, bias=False))
    net = bdl.lift(network, prior=bdl.priors.IIDNormal(0.5))
    guides = {}
    for name, curvature in {"dense": Kron(), "sketched": Kron(max_dense=16, rank=4)}.items():
        guides[name] = LaplaceGuide(helpers.classifier(net), curvature=curvature)
        loader = DataLoader(TensorDataset(x, y), batch_size=8)
        guides[name].fit(loader, len(x), map=False, progress=False)
    (block,) = guides["sketched"].laplace_fit.blocks
    assert block.input_factor.rank == 4 and block.complement == 3 * (30 - 4)
    # the sketch and its test matrix (30 x (2k + 8) each) and the 3 x 3 output factor
    assert guides["sketched"].curvature.memory()["0.weight"] == 2 * 30 * 16 + 3 * 3
    dense, sketched = (guides[n].log_marginal_likelihood() for n in ("dense", "sketched"))
    if exact:  # the inputs span 2 dimensions: rank 4 holds the factor exactly
        torch.testing.assert_close(sketched, dense)
    else:  # truncation drops curvature: the log determinant can only fall
        assert sketched > dense and math.isfinite(float(sketched))


@pytest.mark.parametrize("width, dense", [(1024, True), (1025, False)])
def test_default_kron_sketches_factors_wider_than_1024(helpers, width, dense):
    # The default keeps BERT-sized factors exact and a Llama's hidden-state factor sketched
    # at rank 64: a dense 4096-wide factor per q/v adapter would outweigh LoRA training.
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, width, generator=generator), torch.randint(0, 2, (8,))
    net = bdl.lift(torch.nn.Sequential(torch.nn.Linear(width, 2, bias=False)))
    guide = LaplaceGuide(helpers.classifier(net), curvature=Kron())
    guide.fit(DataLoader(TensorDataset(x, y), batch_size=4), 8, map=False, progress=False)
    held = guide.curvature.memory()["0.weight"] - 2 * 2  # less the 2 x 2 output factor
    assert held == (width * width if dense else 2 * width * (2 * 64 + 8))
