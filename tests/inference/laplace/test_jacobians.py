"""Per-example gradients of a model's output: factored linear, vmapped and looped paths."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch.func import functional_call, jacrev

import pyro_bdl as bdl
from pyro_bdl.inference.laplace.jacobians import DenseGradient, LinearGradient, ModelJacobians


class SharedLinear(torch.nn.Module):
    """Linear layers applied to every token, then pooled: weights shared over positions."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(4, 6)
        self.second = torch.nn.Linear(6, 3)

    def forward(self, x):
        hidden = torch.tanh(self.first(x))  # (B, T, 6)
        return self.second(hidden).mean(1) + self.second(hidden[:, :1]).squeeze(1)


def model_of(net):
    def model(batch, num_data):
        x, y = batch
        logits = net(x)
        bdl.observe("y", dist.Categorical(logits=logits), y, num_data)
        return logits

    return model


def reference(module, values, x, columns):
    """J_i^T v_{c,i} per example from torch.func.jacrev, one example at a time."""
    out = {}
    for name in values:
        rows = []
        for i in range(x.shape[0]):
            jac = jacrev(lambda p, i=i: functional_call(module, p, (x[i : i + 1],))[0])(values)
            rows.append(torch.einsum("ck,k...->c...", columns[:, i], jac[name]))
        out[name] = torch.stack(rows, 1)
    return out


@pytest.fixture
def problem():
    module = SharedLinear()
    net = bdl.lift(module, prior=bdl.priors.IIDNormal(1.0))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 7, 4, generator=generator)
    y = torch.randint(0, 3, (5,), generator=generator)
    return module, net, x, y


def gradients(jacobians, x, y):
    run = jacobians(((x, y), 5), {})
    columns = run.observation.columns("ggn")
    return run.gradients(columns), columns


def test_linear_sites_give_factored_per_example_gradients(problem):
    module, net, x, y = problem
    jacobians = ModelJacobians(model_of(net), net.init_values())
    grads, columns = gradients(jacobians, x, y)
    expected = reference(module, net.init_values(), x, columns)
    assert all(isinstance(grad, LinearGradient) for grad in grads.values())
    assert all(jacobians.factored_verified.values())
    # every call feeds every class: the one-pass path (ChoiceTexts') is learnt not to apply
    assert jacobians._separable is False
    grads_again, _ = gradients(jacobians, x, y)
    for name, grad in grads_again.items():
        assert torch.equal(grad.per_example(), grads[name].per_example())
    for name, grad in grads.items():
        assert torch.allclose(grad.per_example(), expected[name], atol=1e-12)
        dense = DenseGradient(grad.per_example())
        assert torch.allclose(grad.sum_of_squares(), dense.sum_of_squares(), atol=1e-12)
        weight = torch.rand(grad.per_example().shape[2:])
        assert torch.allclose(grad.gram(weight), dense.gram(weight), atol=1e-12)


def test_other_sites_are_vmapped_and_fall_back_to_a_loop(problem):
    module, net, x, y = problem
    expected = None
    for fallback in (False, True):
        jacobians = ModelJacobians(model_of(net), net.init_values())
        jacobians.factored_verified = {site: False for site in net.random_sites}
        jacobians._vmap_failed = fallback
        grads, columns = gradients(jacobians, x, y)
        expected = expected or reference(module, net.init_values(), x, columns)
        for name, grad in grads.items():
            assert isinstance(grad, DenseGradient)
            assert torch.allclose(grad.per_example(), expected[name], atol=1e-12)


def test_a_model_that_cannot_be_vmapped_warns_and_is_looped():
    def model(batch, num_data):
        x, y = batch
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([4, 3]).to_event(2))
        if x.abs().max().item() > 1e6:  # data-dependent Python control flow
            x = x / 2
        bdl.observe("y", dist.Categorical(logits=x @ w), y, num_data)

    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    w = torch.randn(4, 3)
    jacobians = ModelJacobians(model, {"w": w})
    run = jacobians(((x, y), 6), {})
    columns = run.observation.columns("ef")
    with pytest.warns(UserWarning, match="one example at a time"):
        grads = run.gradients(columns)
    probs = torch.softmax(x @ w, -1)
    score = torch.nn.functional.one_hot(y, 3) - probs  # d log p / d logits
    expected = torch.einsum("bi,bk->bik", x, score).unsqueeze(0)
    assert torch.allclose(grads["w"].per_example(), expected, atol=1e-12)


def test_a_weight_used_outside_linear_is_detected_and_made_dense(problem):
    _, _, x, y = problem

    # A weight used twice, once through linear and once directly, is only partly seen
    # by the recorded linear calls.
    class Tied(SharedLinear):
        def forward(self, x):
            return super().forward(x) + x.mean(1)[:, :3] @ self.second.weight[:, :3]

    tied = Tied()
    net = bdl.lift(tied, prior=bdl.priors.IIDNormal(1.0))
    jacobians = ModelJacobians(model_of(net), net.init_values())
    grads, columns = gradients(jacobians, x, y)
    assert jacobians.factored_verified["second.weight"] is False
    assert jacobians.factored_verified["first.weight"] is True
    assert isinstance(grads["second.weight"], DenseGradient)
    expected = reference(tied, net.init_values(), x, columns)
    for name, grad in grads.items():
        assert torch.allclose(grad.per_example(), expected[name], atol=1e-12)


def test_embeddings_convolutions_and_recurrences_are_factored():
    pytest.importorskip("pyro_bdl.models")
    from pyro_bdl.models import CNNLSTM

    torch.manual_seed(0)
    module = CNNLSTM(
        vocab_size=30, embedding_dim=6, num_filters=4, kernel_size=3, pool_size=2, hidden_size=5
    )
    module.embedding.padding_idx = 0  # the padding row must get no gradient
    net = bdl.lift(module, prior=bdl.priors.IIDNormal(1.0))
    generator = torch.Generator().manual_seed(2)
    x = torch.randint(0, 30, (4, 12), generator=generator)
    x[0, :3] = 0
    y = torch.randint(0, 2, (4,), generator=generator)
    jacobians = ModelJacobians(model_of(net), net.init_values())
    grads, columns = gradients(jacobians, x, y)
    kinds = {name: type(grad).__name__ for name, grad in grads.items()}
    assert kinds["embedding.weight"] == "EmbeddingGradient"
    # conv: a linear map of patches; lstm.weight_hh: addmm(x, h, W.T) at every step
    others = [name for name in kinds if name != "embedding.weight"]
    assert all(kinds[name] == "LinearGradient" for name in others), kinds
    expected = reference(module, net.init_values(), x, columns)
    for name, grad in grads.items():
        assert torch.allclose(grad.per_example(), expected[name], atol=1e-12), name
    table = grads["embedding.weight"]
    dense = DenseGradient(table.per_example())
    weight = torch.rand(30, 6)
    assert torch.all(table.per_example()[:, :, 0] == 0)
    assert torch.allclose(table.sum_of_squares(), dense.sum_of_squares(), atol=1e-12)
    assert torch.allclose(table.gram(weight), dense.gram(weight), atol=1e-12)
    assert torch.allclose(table.total(0), dense.total(0), atol=1e-12)


def test_a_strided_padded_2d_convolution_is_a_linear_map_of_patches():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.conv = torch.nn.Conv2d(2, 3, (3, 2), stride=(2, 1), padding=1, dilation=(1, 2))
            self.head = torch.nn.Parameter(torch.randn(4, 3 * 3 * 5))

        def forward(self, x):
            hidden = torch.tanh(self.conv(x)).flatten(1)
            return hidden @ self.head.t()  # a plain matmul by a transposed weight

    module = Net()
    net = bdl.lift(module, prior=bdl.priors.IIDNormal(1.0))
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2, 5, 5, generator=generator)
    y = torch.randint(0, 4, (5,), generator=generator)
    jacobians = ModelJacobians(model_of(net), net.init_values())
    grads, columns = gradients(jacobians, x, y)
    assert all(isinstance(grad, LinearGradient) for grad in grads.values())
    assert all(jacobians.factored_verified.values())
    expected = reference(module, net.init_values(), x, columns)
    for name, grad in grads.items():
        assert torch.allclose(grad.per_example(), expected[name], atol=1e-12), name
