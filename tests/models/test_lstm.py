import pytest
import torch

from pyro_bdl.models import LSTM


def _lstm_pair(input_size: int = 5, hidden_size: int = 7) -> tuple[LSTM, torch.nn.LSTM]:
    """Our LSTM with the weights of an nn.LSTM, its two biases summed into one."""
    torch.manual_seed(0)
    reference = torch.nn.LSTM(input_size, hidden_size, batch_first=True).double()
    lstm = LSTM(input_size, hidden_size).double()
    with torch.no_grad():
        lstm.weight_ih.copy_(reference.weight_ih_l0)
        lstm.weight_hh.copy_(reference.weight_hh_l0)
        lstm.bias.copy_(reference.bias_ih_l0 + reference.bias_hh_l0)
    return lstm, reference


def test_equals_torch_lstm_with_summed_biases():
    lstm, reference = _lstm_pair()
    x = torch.randn(3, 11, 5, dtype=torch.float64)
    outputs, (h, c) = lstm(x)
    expected, (h_ref, c_ref) = reference(x)
    torch.testing.assert_close(outputs, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(h, h_ref[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(c, c_ref[0], rtol=0, atol=1e-12)


def test_one_bias_per_gate():
    lstm = LSTM(64, 128)
    reference = torch.nn.LSTM(64, 128)
    count = sum(p.numel() for p in lstm.parameters())
    assert count == sum(p.numel() for p in reference.parameters()) - 4 * 128


def test_per_example_gradients_with_vmap():
    lstm, _ = _lstm_pair()
    params = {name: p.detach() for name, p in lstm.named_parameters()}
    x = torch.randn(4, 6, 5, dtype=torch.float64)

    def loss(params, x):
        outputs, _ = torch.func.functional_call(lstm, params, (x.unsqueeze(0),))
        return outputs[:, -1].square().sum()

    batched = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for i in range(len(x)):
        one = torch.func.grad(loss)(params, x[i])
        for name in params:
            torch.testing.assert_close(batched[name][i], one[name], rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", [(3, 6), (3, 0, 5), (3, 6, 4)])
def test_rejects_wrong_input_shape(shape):
    with pytest.raises(ValueError, match="input must have shape"):
        LSTM(5, 7)(torch.randn(shape))


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        LSTM(5, 0)
