"""K-FAC against laplace-torch (curvlinops), the expand convention, and the block algebra."""

import copy
import math

import pyro.distributions as dist
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import pyro_bdl as bdl
from pyro_bdl.inference import LaplaceGuide
from pyro_bdl.inference.laplace.curvature import DiagonalBlock, Kron, KronBlock
from pyro_bdl.inference.laplace.jacobians import DenseGradient
from pyro_bdl.models import DictLogits


@pytest.mark.parametrize(
    "fisher, backend", [("ggn", "CurvlinopsGGN"), ("ef", "CurvlinopsEF")], ids=["ggn", "ef"]
)
def test_matches_laplace_torch_on_an_mlp(fisher, backend, helpers, laplace_torch):
    # Without biases every site is a K-FAC layer (laplace-torch gives biases a dense
    # block, we a diagonal one).
    network = helpers.mlp(bias=False)
    x, y = helpers.classification_data()
    reference = laplace_torch.KronLaplace(
        copy.deepcopy(network),
        "classification",
        prior_precision=3.0,
        backend=getattr(laplace_torch.curvature, backend),
    )
    reference.fit(DataLoader(TensorDataset(x, y), batch_size=len(x)))
    net = bdl.lift(network, prior=bdl.priors.IIDNormal(3.0**-0.5))
    guide = LaplaceGuide(helpers.classifier(net), curvature=Kron(fisher=fisher))
    guide.fit(DataLoader(TensorDataset(x, y), batch_size=20), len(x), map=False, progress=False)

    assert all(isinstance(block, KronBlock) for block in guide.laplace_fit.blocks)
    assert torch.allclose(
        guide.log_marginal_likelihood(), reference.log_marginal_likelihood(), rtol=1e-4
    )
    mean, covariance = guide.output_distribution((x, y), len(x))
    f_mean, f_covariance = reference._glm_predictive_distribution(x)
    assert torch.allclose(covariance, f_covariance, rtol=1e-4, atol=1e-10)
    for link in ("probit", "mc"):
        generator = torch.Generator().manual_seed(0) if link == "mc" else None
        ours = guide.predictive((x, y), len(x), link=link, num_samples=20000, generator=generator)
        theirs = reference(x, link_approx=link, n_samples=20000)
        # MC: two independent averages of 20000 softmax draws (sd < 0.5 / sqrt(20000)).
        assert torch.allclose(ours, theirs, atol=1e-10 if link == "probit" else 0.02)


def test_tokens_share_the_weight_by_the_expand_convention(helpers, laplace_torch):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=3,
        initializer_range=0.3,  # curvature of order 1 in every LoRA factor (0.02: 1e-7)
    )
    lora = peft.get_peft_model(
        transformers.BertForSequenceClassification(config),
        peft.LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"], task_type="SEQ_CLS"),
    )
    for name, param in lora.named_parameters():
        if "lora_B" in name:  # LoRA starts at B = 0; give the curvature something to see
            torch.nn.init.normal_(param, std=1.0)
        param.requires_grad_(param.requires_grad and not name.endswith("bias"))
    lora.eval()
    num_data, length = 24, 7
    ids = torch.randint(0, 50, (num_data, length))
    mask = torch.ones(num_data, length, dtype=torch.long)
    mask[::3, -2:] = 0  # padded sequences
    labels = torch.randint(0, 3, (num_data,))
    rows = [
        {"input_ids": i, "attention_mask": m, "labels": t} for i, m, t in zip(ids, mask, labels)
    ]

    def collate(batch):
        return {key: torch.stack([row[key] for row in batch]) for key in batch[0]}

    # A prior precision of 0.1 under LoRA curvatures up to 3: the curvature dominates.
    reference = laplace_torch.KronLaplace(
        DictLogits(copy.deepcopy(lora)),
        "classification",
        prior_precision=0.1,
        backend=laplace_torch.curvature.CurvlinopsGGN,
    )
    reference.fit(DataLoader(rows, batch_size=num_data, collate_fn=collate))
    net = bdl.lift(lora, prior=bdl.priors.IIDNormal(0.1**-0.5))

    def model(batch, num_data):
        logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        bdl.observe("y", dist.Categorical(logits=logits), batch["labels"], num_data)
        return logits

    guide = LaplaceGuide(model, curvature="kron")
    guide.fit(
        DataLoader(rows, batch_size=8, collate_fn=collate), num_data, map=False, progress=False
    )
    assert (
        sum(isinstance(block, KronBlock) for block in guide.laplace_fit.blocks) == 9
    )  # 8 LoRA + head
    # Factor by factor: each site's curvature (its precision less the prior) against
    # laplace-torch's Kronecker block of that parameter, relative to its own size.
    names = [name for name, p in reference.model.named_parameters() if p.requires_grad]
    sizes = [p.numel() for p in reference.model.parameters() if p.requires_grad]
    offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    curvature = reference.H.to_matrix()
    for block in guide.laplace_fit.blocks:
        (site,) = block.sites
        (index,) = [i for i, name in enumerate(names) if name.endswith("." + site)]
        theirs = curvature[offsets[index] : offsets[index + 1], offsets[index] : offsets[index + 1]]
        ours = helpers.dense_precision(block, guide.prior_precision) - 0.1 * torch.eye(len(theirs))
        assert theirs.abs().max() > 0.1  # LoRA A factors reach 3, B factors 0.2 to 0.4
        assert (ours - theirs).abs().max() < 1e-10 * theirs.abs().max()
    assert torch.allclose(
        guide.log_marginal_likelihood(), reference.log_marginal_likelihood(), rtol=1e-4
    )
    batch = collate(rows)
    _, covariance = guide.output_distribution(batch, num_data)
    _, f_covariance = reference._glm_predictive_distribution(batch)
    assert torch.allclose(covariance, f_covariance, rtol=1e-4, atol=1e-10)


def test_biases_get_a_diagonal_ggn_block(helpers):
    network = helpers.mlp(bias=True)
    x, y = helpers.classification_data()
    net = bdl.lift(network, prior=bdl.priors.IIDNormal(1.0))
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    kron = LaplaceGuide(helpers.classifier(net), curvature="kron").fit(
        loader, len(x), map=False, progress=False
    )
    diagonal = LaplaceGuide(helpers.classifier(net), curvature="diag_ggn")
    diagonal.fit(loader, len(x), map=False, progress=False)
    kinds = {block.sites[0]: type(block) for block in kron.laplace_fit.blocks}
    assert kinds == {
        "0.weight": KronBlock,
        "0.bias": DiagonalBlock,
        "2.weight": KronBlock,
        "2.bias": DiagonalBlock,
    }
    for name in ("0.bias", "2.bias"):
        assert torch.allclose(kron.variance()[name], diagonal.variance()[name], atol=1e-12)


def random_block(d_out=4, d_in=3, ranks=None, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def factor(dim, rank):
        root = torch.randn(dim, dim, generator=generator)
        values, vectors = torch.linalg.eigh(root @ root.T)
        return vectors[:, -rank:], values[-rank:]

    ranks = ranks or (d_in, d_out)
    return KronBlock("w", factor(d_in, ranks[0]), factor(d_out, ranks[1]))


@pytest.mark.parametrize("ranks", [None, (2, 3)], ids=["complete", "truncated"])
def test_block_algebra_equals_the_dense_precision(ranks, helpers):
    block = random_block(ranks=ranks)
    delta = {"w": torch.tensor(0.7)}
    a = block.input_vectors @ torch.diag(block.input_values) @ block.input_vectors.T
    b = block.output_vectors @ torch.diag(block.output_values) @ block.output_vectors.T
    # Row-major flattening: (A kron B) vec(W) = vec(B W A) becomes kron(B, A) @ W.flatten().
    precision = torch.kron(b, a) + 0.7 * torch.eye(12)
    assert torch.allclose(helpers.dense_precision(block, delta), precision, atol=1e-10)
    assert torch.allclose(block.log_det(delta), torch.logdet(precision))
    covariance = torch.linalg.inv(precision)
    assert torch.allclose(block.variance(delta)["w"].flatten(), covariance.diagonal())
    # sample() applies the symmetric root of the covariance: apply it to the identity.
    root = block.sample({"w": torch.eye(12).reshape(12, 4, 3)}, delta)["w"].reshape(12, 12)
    assert torch.allclose(root @ root.T, covariance, atol=1e-10)
    assert torch.allclose(root, root.T, atol=1e-10)
    # The predictive covariance of per-example Jacobian rows J: J Sigma J^T.
    jac = torch.randn(2, 5, 4, 3)
    output = block.output_covariance({"w": DenseGradient(jac)}, delta)
    rows = jac.flatten(2)
    assert torch.allclose(output, torch.einsum("cbp,pq,dbq->bcd", rows, covariance, rows))
    assert math.isclose(block.complement, 0 if ranks is None else 12 - 6)


def test_the_fit_does_not_depend_on_the_batch_size(helpers):
    network = helpers.mlp(bias=False)
    x, y = helpers.classification_data(num_data=48)
    net = bdl.lift(network, prior=bdl.priors.IIDNormal(1.0))
    evidences = []
    for batch_size in (48, 16, 5):
        guide = LaplaceGuide(helpers.classifier(net), curvature="kron")
        guide.fit(
            DataLoader(TensorDataset(x, y), batch_size=batch_size), 48, map=False, progress=False
        )
        evidences.append(guide.log_marginal_likelihood())
    assert torch.allclose(torch.stack(evidences), evidences[0], rtol=1e-10)


def test_a_convolution_is_factored_as_laplace_torch_does(helpers, laplace_torch):
    torch.manual_seed(0)
    network = torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3, padding=1, bias=False),
        torch.nn.Tanh(),
        torch.nn.Flatten(),
        torch.nn.Linear(3 * 4 * 4, 3, bias=False),
    )
    x = torch.randn(30, 2, 4, 4)
    _, y = helpers.classification_data(num_data=30)
    reference = laplace_torch.KronLaplace(
        copy.deepcopy(network),
        "classification",
        prior_precision=2.0,
        backend=laplace_torch.curvature.CurvlinopsGGN,
    )
    reference.fit(DataLoader(TensorDataset(x, y), batch_size=30))
    net = bdl.lift(network, prior=bdl.priors.IIDNormal(2.0**-0.5))
    guide = LaplaceGuide(helpers.classifier(net), curvature="kron")
    guide.fit(DataLoader(TensorDataset(x, y), batch_size=8), 30, map=False, progress=False)
    assert isinstance(guide.laplace_fit.blocks[0], KronBlock) and guide.laplace_fit.blocks[
        0
    ].shape == (3, 2, 3, 3)
    assert torch.allclose(
        guide.log_marginal_likelihood(), reference.log_marginal_likelihood(), rtol=1e-4
    )
    _, covariance = guide.output_distribution((x, y), 30)
    _, f_covariance = reference._glm_predictive_distribution(x)
    assert torch.allclose(covariance, f_covariance, rtol=1e-4, atol=1e-10)
    # The kernel-shaped block samples with the covariance of its precision.
    block, delta = guide.laplace_fit.blocks[0], guide.prior_precision
    covariance = torch.linalg.inv(helpers.dense_precision(block, delta))
    rows = block.sample({block.site: torch.eye(54).reshape(54, 3, 2, 3, 3)}, delta)[block.site]
    assert torch.allclose(rows.reshape(54, 54) @ rows.reshape(54, 54).T, covariance, atol=1e-10)
    assert torch.allclose(block.variance(delta)[block.site].flatten(), covariance.diagonal())


@pytest.mark.parametrize("curvature", ["kron", "kron_lowrank"])
def test_scalar_and_vector_sites_fall_back_to_the_exact_diagonal(curvature, linear_gaussian):
    # A 0-d site (an offset) and a 1-d site used by x @ w, not a linear layer's weight:
    # both get the diagonal GGN, which equals the diagonal of the exact precision.
    import pyro

    problem = linear_gaussian

    def model(batch, num_data):
        x, y = batch
        w = pyro.sample("w", dist.Normal(0.0, problem.alpha**-0.5).expand([3]).to_event(1))
        b = pyro.sample("b", dist.Normal(0.0, 1.0))
        bdl.observe("y", dist.Normal(x @ w + b, problem.sigma), y, num_data)
        return x @ w + b

    guides = {}
    for name in (curvature, "diag_ggn"):
        guides[name] = LaplaceGuide(model, curvature=name)
        guides[name].fit(problem.loader(), problem.num_data, map=False, progress=False)
    assert all(isinstance(block, DiagonalBlock) for block in guides[curvature].laplace_fit.blocks)
    for site, variance in guides["diag_ggn"].variance().items():
        torch.testing.assert_close(guides[curvature].variance()[site], variance)
    x = problem.x
    exact = {"w": x.square().sum(0) / problem.sigma**2 + problem.alpha,
             "b": torch.tensor(len(x) / problem.sigma**2 + 1.0)}  # fmt: skip
    for site, precision in exact.items():
        torch.testing.assert_close(guides[curvature].variance()[site], precision.reciprocal())
    torch.testing.assert_close(
        guides[curvature].log_marginal_likelihood(), guides["diag_ggn"].log_marginal_likelihood()
    )


class _TwoHeads(torch.nn.Module):
    """Two linear heads reading one hidden layer, as LoRA's query and value A read one input."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(5, 6)
        self.left = torch.nn.Linear(6, 3, bias=False)
        self.right = torch.nn.Linear(6, 3, bias=False)

    def forward(self, x):
        hidden = torch.tanh(self.trunk(x))
        return self.left(hidden) + self.right(hidden)


def test_layers_reading_one_input_share_one_input_factor(helpers, laplace_torch):
    x, y = helpers.classification_data()
    heads = ["left.weight", "right.weight"]
    net = bdl.lift(_TwoHeads(), bdl.priors.IIDNormal(1.0), random=heads)
    guide = LaplaceGuide(helpers.classifier(net), curvature="kron")
    guide.fit(DataLoader(TensorDataset(x, y), batch_size=16), len(x), map=False, progress=False)
    left, right = guide.laplace_fit.blocks
    assert left.input_factor is right.input_factor  # one factor, decomposed once
    # the same posterior as two separately accumulated factors (laplace-torch's way)
    module = copy.deepcopy(net.module)
    for name, param in module.named_parameters():
        param.requires_grad_(name in heads)
    reference = laplace_torch.KronLaplace(
        module, "classification", prior_precision=1.0, backend=laplace_torch.curvature.CurvlinopsGGN
    )
    reference.fit(DataLoader(TensorDataset(x, y), batch_size=len(x)))
    torch.testing.assert_close(
        guide.log_marginal_likelihood(), reference.log_marginal_likelihood(), rtol=1e-4, atol=0
    )


@pytest.mark.parametrize(
    "d_out, d_in, positions", [(20, 20, 2), (2, 20, 30)], ids=["project-first", "rows-first"]
)
@pytest.mark.parametrize("ranks", [None, (5, 2)], ids=["complete", "truncated"])
def test_factored_predictive_covariance_equals_the_dense_one(d_out, d_in, positions, ranks):
    from pyro_bdl.inference.laplace.curvature.kron import _project_first
    from pyro_bdl.inference.laplace.jacobians import LinearGradient

    block = random_block(d_out, d_in, ranks=ranks)
    generator = torch.Generator().manual_seed(1)
    grad = LinearGradient(
        torch.randn(3, positions, d_in, generator=generator),
        torch.randn(2, 3, positions, d_out, generator=generator),
    )
    k_in, k_out = block.input_factor.rank, block.output_factor.rank
    assert _project_first(grad, k_in, k_out) == (d_out == 20)
    delta = {"w": torch.tensor(0.3)}
    dense = DenseGradient(grad.per_example())
    torch.testing.assert_close(
        block.output_covariance({"w": grad}, delta), block.output_covariance({"w": dense}, delta)
    )


def test_monte_carlo_fisher_converges_to_the_ggn(helpers):
    # For a softmax likelihood the Fisher is the GGN: the MC factors average the outer
    # products of scores at sampled labels, 60 examples x 400 labels here, so each
    # entry of the output factor is off by about 1 / sqrt(24000) < 1 % of its scale.
    network = helpers.mlp(bias=False)
    x, y = helpers.classification_data()
    net = bdl.lift(network, prior=bdl.priors.IIDNormal(1.0))
    loader = DataLoader(TensorDataset(x, y), batch_size=20)
    fits = {}
    for name, curvature in [("ggn", "kron"), ("mc", Kron(fisher="mc", num_samples=400))]:
        torch.manual_seed(0)
        guide = LaplaceGuide(helpers.classifier(net), curvature=curvature)
        fits[name] = guide.fit(loader, len(x), map=False, progress=False)
    for exact, sampled in zip(fits["ggn"].laplace_fit.blocks, fits["mc"].laplace_fit.blocks):
        delta = fits["ggn"].prior_precision
        exact_matrix = helpers.dense_precision(exact, delta)
        sampled_matrix = helpers.dense_precision(sampled, delta)
        identity = torch.eye(len(exact_matrix))  # the prior precision, 1
        exact_matrix, sampled_matrix = exact_matrix - identity, sampled_matrix - identity
        error = (sampled_matrix - exact_matrix).norm() / exact_matrix.norm()
        assert 1e-4 < error < 0.05  # sampled, not exact, and converging
    evidence = [fits[name].log_marginal_likelihood() for name in ("ggn", "mc")]
    assert torch.allclose(*evidence, rtol=0.01)
