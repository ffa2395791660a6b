import re
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide.initialization import InitMessenger

import pyro_bdl as bdl


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def test_default_makes_every_trainable_parameter_a_site_with_its_prior():
    net = bdl.lift(_mlp(), prior=bdl.priors.IIDNormal(0.5))
    trace = pyro.poutine.trace(net).get_trace(torch.randn(5, 3))
    sites = {n: s for n, s in trace.nodes.items() if s["type"] == "sample"}
    assert set(sites) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert sites["0.weight"]["fn"].event_shape == (4, 3)
    assert sites["0.weight"]["fn"].batch_shape == ()
    value = sites["0.weight"]["value"]
    expected = dist.Normal(0.0, 0.5).log_prob(value).sum()
    assert torch.allclose(sites["0.weight"]["fn"].log_prob(value), expected)


def test_forward_uses_the_sampled_values_and_leaves_the_module_untouched():
    module = _mlp()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    net = bdl.lift(module)
    values = {n: torch.zeros_like(p) for n, p in module.named_parameters()}
    x = torch.randn(5, 3)
    out = pyro.poutine.condition(net, data=values)(x)
    assert torch.equal(out, torch.zeros(5, 2))
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k])


def test_selection_by_substring_list_and_predicate():
    module = _mlp()
    lifted = bdl.lift(module, random="weight", point="bias")
    assert set(lifted.random_sites) == {"0.weight", "2.weight"}
    lifted = bdl.lift(module, random=["2.bias"], frozen=lambda name, p: name != "2.bias")
    assert set(lifted.random_sites) == {"2.bias"}
    chosen = bdl.lift(module, random=lambda name, p: p.dim() == 1, frozen="weight")
    assert set(chosen.random_sites) == {"0.bias", "2.bias"}


def test_point_weights_are_params_and_the_rest_of_the_default_is_random():
    module = _mlp()
    net = bdl.lift(module, point="bias")
    assert set(net.point_sites) == {"0.bias", "2.bias"}
    assert set(net.random_sites) == {"0.weight", "2.weight"}
    trace = pyro.poutine.trace(net).get_trace(torch.randn(2, 3))
    assert trace.nodes["0.bias"]["type"] == "param"
    assert torch.equal(pyro.param("0.bias"), module[0].bias)


def test_frozen_parameters_are_never_sites_nor_params():
    module = _mlp()
    module[0].weight.requires_grad_(False)
    net = bdl.lift(module)
    assert "0.weight" not in net.random_sites
    pyro.poutine.trace(net).get_trace(torch.randn(2, 3))
    assert "0.weight" not in pyro.get_param_store()
    with pytest.raises(ValueError, match="not trainable"):
        bdl.lift(module, random=["0.weight"])


def test_bad_selection_names_the_argument():
    with pytest.raises(ValueError, match="random='lora_' matches no trainable"):
        bdl.lift(_mlp(), random="lora_")
    with pytest.raises(ValueError, match="both random and point"):
        bdl.lift(_mlp(), random="bias", point="0.")
    with pytest.raises(TypeError, match="random must be"):
        bdl.lift(_mlp(), random=3)


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.out = torch.nn.Linear(3, 5, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(self.embed(ids))


def test_tied_weights_stay_tied():
    module = _Tied()
    net = bdl.lift(module)
    assert set(net.random_sites) == {"embed.weight"}
    weight = torch.randn(5, 3)
    out = pyro.poutine.condition(net, data={"embed.weight": weight})(torch.tensor([1]))
    assert torch.allclose(out, weight[1] @ weight.T)


def test_fixed_runs_any_method_with_one_draw_and_restores_the_weights():
    module = _mlp()
    original = module[2].weight.detach().clone()
    net = bdl.lift(module, random="2.", frozen="0.")
    draw = {"2.weight": torch.ones(2, 4), "2.bias": torch.zeros(2), "unrelated": torch.ones(1)}
    x = torch.randn(3, 3)
    with pytest.raises(ValueError, match="fixed\\(values\\): unknown site 'unrelated'"):
        with net.fixed(draw):
            pass
    with net.fixed(draw, strict=False):
        hidden = torch.tanh(module[0](x))
        assert torch.allclose(module(x), hidden.sum(-1, keepdim=True).expand(3, 2))
        trace = pyro.poutine.trace(net).get_trace(x)
        assert not [s for s in trace.nodes.values() if s["type"] == "sample"]
    assert torch.equal(module[2].weight, original)
    with pytest.raises(KeyError, match="no value for the random sites"):
        with net.fixed({"2.weight": torch.ones(2, 4)}):
            pass


def test_prior_with_wrong_shape_is_rejected():
    class Bad:
        def distribution(self, name, param):
            return dist.Normal(0.0, 1.0).expand(param.shape)

    net = bdl.lift(_mlp(), prior=Bad())
    with pytest.raises(ValueError, match="batch shape"):
        net(torch.randn(1, 3))


def _tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=20,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=8,
        num_labels=3,
    )
    return BertForSequenceClassification(config)


def _tiny_peft_classifier():
    """A BERT classifier of random weights with peft LoRA and a new trainable head."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=2, target_modules=["query", "value"], task_type="SEQ_CLS")
    return get_peft_model(_tiny_bert(), lora)


def test_a_trainable_weight_left_out_warns_and_names_it():
    """Issue 10 item 10: random="lora_" left peft's new head at its initialisation, silently."""
    peft_model = _tiny_peft_classifier()
    with pytest.warns(UserWarning, match=r"neither random, point nor frozen: \['.*classifier"):
        bdl.lift(peft_model, prior=bdl.priors.IIDNormal(0.2), random="lora_")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the README's recipe: every trainable weight, adapters and head, is random
        net = bdl.lift(peft_model, prior=bdl.priors.IIDNormal(0.2))
        assert any("classifier" in site for site in net.random_sites)
        point = bdl.lift(peft_model, random="lora_", point="modules_to_save")
        assert all("classifier" in site for site in point.point_sites)
        held = bdl.lift(peft_model, random="lora_", frozen="modules_to_save")
        assert not any("classifier" in site for site in held.random_sites)


def test_the_readme_recipe_learns_the_head():
    peft_model = _tiny_peft_classifier()
    net = bdl.lift(peft_model, prior=bdl.priors.IIDNormal(0.2))
    head = next(site for site in net.random_sites if "classifier" in site and "weight" in site)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 20, (16, 6), generator=generator)
    labels = torch.randint(0, 3, (16,), generator=generator)

    def model(ids, labels):
        logits = net(input_ids=ids).logits
        bdl.observe("y", dist.Categorical(logits=logits), labels, len(labels))

    fitted = bdl.inference.fit_map(
        model, ids, labels, num_steps=5, optimizer=pyro.optim.Adam({"lr": 0.1}), progress=False
    )
    assert not torch.allclose(fitted[head], net.parameter(head))


def test_frozen_weights_keep_their_value_and_get_no_gradient():
    module = _mlp()
    net = bdl.lift(module, random="2.", frozen="0.")
    x = torch.randn(5, 3)
    values = {"2.weight": torch.randn(2, 4, requires_grad=True), "2.bias": torch.zeros(2)}
    out = pyro.poutine.condition(net, data=values)(x)
    assert torch.allclose(out, torch.tanh(module[0](x)) @ values["2.weight"].T)
    out.sum().backward()
    assert module[0].weight.grad is None and values["2.weight"].grad is not None


def test_library_models_select_every_trainable_weight():
    from pyro_bdl.models import CNNLSTM, cnn_lstm_model, lora_model

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        cnn_lstm_model(CNNLSTM(vocab_size=30, embedding_dim=4, num_filters=4, hidden_size=4))
        for head in ("random", "point", "lora", "frozen"):
            lora_model(_tiny_bert(), "classification", head=head, rank=2, target_modules=["query"])
        lora_model(_tiny_bert(), "classification", adapters_random="A", rank=2)


def test_a_batch_of_draws_runs_the_module_once_per_draw():
    """Issue 10 item 9: Predictive(parallel=True) hands the network a batch of weights."""
    module = _mlp()
    net = bdl.lift(module, prior=bdl.priors.IIDNormal(0.5))
    x = torch.randn(5, 3)
    draws = {name: torch.randn(4, *p.shape) for name, p in module.named_parameters()}
    out = pyro.poutine.condition(net, data=draws)(x)
    for i in range(4):
        with net.fixed({name: value[i] for name, value in draws.items()}):
            assert torch.allclose(out[i], module(x))
    padded = {name: value.unsqueeze(1) for name, value in draws.items()}  # Pyro's (S, 1, ...)
    assert torch.allclose(pyro.poutine.condition(net, data=padded)(x), out)


def test_a_hugging_face_classifier_under_parallel_predictive():
    peft_model = _tiny_peft_classifier().eval()
    net = bdl.lift(peft_model, prior=bdl.priors.IIDNormal(0.2))
    ids = torch.randint(0, 20, (3, 6), generator=torch.Generator().manual_seed(0))

    def model(ids, num_data):
        logits = net(input_ids=ids).logits
        bdl.observe("y", dist.Categorical(logits=logits), None, num_data)
        return logits

    pyro.set_rng_seed(0)
    out = pyro.infer.Predictive(model, num_samples=4, parallel=True, return_sites=["_RETURN", "y"])(
        ids, 10
    )
    assert out["_RETURN"].shape == (4, 3, 3) and out["y"].shape == (4, 3)
    pyro.set_rng_seed(0)
    sequential = pyro.infer.Predictive(model, num_samples=4, return_sites=["_RETURN"])(ids, 10)
    assert out["_RETURN"].shape == sequential["_RETURN"].shape


def test_a_module_that_cannot_be_vectorised_names_the_way_out():
    class DataDependent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 2)

        def forward(self, x):
            out = self.linear(x)
            return out if out.sum().item() > 0 else -out

    net = bdl.lift(DataDependent())
    draws = {name: torch.randn(4, *p.shape) for name, p in net.module.named_parameters()}
    with pytest.raises(RuntimeError, match=r"parallel=False"):
        pyro.poutine.condition(net, data=draws)(torch.randn(5, 3))
    with pytest.raises(ValueError, match=r"'linear.weight' has shape \(4, 3\)"):
        pyro.poutine.condition(net, data={**draws, "linear.weight": torch.randn(4, 3)})(
            torch.randn(5, 3)
        )


def _frozen_mlp():
    module = _mlp()
    module.requires_grad_(False)
    return module


LIFT = [
    ({"module": "mlp"}, TypeError, "module must be a torch.nn.Module"),
    ({"module": _frozen_mlp()}, ValueError, "has no trainable parameters"),
    ({"prior": bdl.priors.IIDNormal}, TypeError, "prior must be a prior object.*pass an instance"),
    ({"prior": 0.2}, TypeError, "prior must be a prior object"),
    ({"random": 3}, TypeError, "random must be a substring"),
    ({"random": [0, 1]}, TypeError, "random must be a substring"),
    ({"random": "lora_"}, ValueError, "random='lora_' matches no trainable"),
    ({"random": lambda name, p: False}, ValueError, "random=.* matches no trainable"),
    ({"random": ["0.weight", "9.weight"]}, ValueError, r"random names .*\['9.weight'\]"),
    ({"point": "head"}, ValueError, "point='head' matches no trainable"),
    ({"frozen": "lstm"}, ValueError, "frozen='lstm' matches no trainable"),
    ({"random": "bias", "point": "0."}, ValueError, "both random and point"),
    ({"point": "bias", "frozen": "0."}, ValueError, "both point and frozen"),
    ({"prefix": 1}, TypeError, "prefix must be a string"),
    (
        {"module": _Tied(), "random": ["out.weight"]},
        ValueError,
        r"tied .*'out.weight': 'embed.weight'",
    ),
]


def _id(value) -> str:
    """The parameter as text, without a function's address (the same in every process)."""
    return re.sub(r" at 0x[0-9a-f]+", "", str(value))


@pytest.mark.parametrize("options, error, message", LIFT, ids=_id)
def test_lift_bad_inputs(options, error, message):
    arguments = {"module": _mlp(), **options}
    with pytest.raises(error, match=message):
        bdl.lift(arguments.pop("module"), **arguments)


def test_a_prior_assigned_later_is_checked_too():
    net = bdl.lift(_mlp())
    with pytest.raises(TypeError, match="prior must be a prior object"):
        net.prior = "normal"


def test_sites_that_are_not_module_weights_start_at_a_feasible_point():
    # Pyro's init_to_feasible: biject_to(support)(0), the same at every call; a HalfCauchy
    # scale (infinite mean, the old default's NaN start) starts at 1, a Uniform(0, 10) at
    # 5, a Normal(3, 1) at 0; a discrete site (a label predicted with obs=None) is drawn.
    def site(fn):
        return {"name": "s", "fn": fn, "infer": {}, "is_observed": False}

    assert bdl.init_to_module(site(dist.HalfCauchy(torch.tensor(25.0)))).item() == 1.0
    assert bdl.init_to_module(site(dist.Uniform(0.0, 10.0))).item() == 5.0
    assert bdl.init_to_module(site(dist.Normal(3.0, 1.0))).item() == 0.0
    label = bdl.init_to_module(site(dist.Categorical(logits=torch.zeros(4))))
    assert label.dtype == torch.long and 0 <= int(label) < 4
    layer = torch.nn.Linear(2, 1)
    net = bdl.lift(layer)
    trace = pyro.poutine.trace(InitMessenger(bdl.init_to_module)(net)).get_trace(torch.ones(2))
    assert torch.equal(trace.nodes["weight"]["value"], layer.weight.detach())


def test_a_network_called_inside_a_subsampled_plate_warns_naming_the_plate():
    # Pyro broadcasts a site inside a plate over it: the weights become one draw per
    # example, which a lifted network's user never means.
    net = bdl.lift(_mlp())
    x = torch.randn(10, 3)
    with pyro.plate("data", 10, subsample_size=4), pytest.warns(UserWarning) as caught:
        net(x[:4])
    (warning,) = [w for w in caught if "lift:" in str(w.message)]
    assert "pyro.plate('data', 10, subsample_size=4)" in str(warning.message)
    assert warning.filename == __file__  # points at the user's call
    trace = pyro.poutine.trace(net).get_trace(x)  # outside any plate: no warning, one draw
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net(x)
    assert all(
        site["value"].shape == param.shape
        for site, param in zip(
            (trace.nodes[name] for name in net.random_sites), net.module.parameters()
        )
    )
    with warnings.catch_warnings():  # a full plate (vectorised particles) is not data
        warnings.simplefilter("error")
        with pyro.plate("particles", 3, dim=-3):
            net(x)
