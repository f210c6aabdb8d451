"""``mtq.quantize`` is all or nothing: a refused config, a forward loop that raises or an interrupt leaves the model
exactly as it was, and the retry with a fixed config works (public API only, as a user's script calls it)."""

import copy
import hashlib

import pytest
import torch
from torch import nn

import modelopt_moe.quantization as mtq


def fingerprint(model: nn.Module) -> tuple:
    """Classes, module tree, attribute names, parameter/buffer identities and bytes, hooks and training mode."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict(keep_vars=True).items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return (
        digest.hexdigest(),
        [(name, type(m).__qualname__, sorted(m.__dict__), sorted(m._modules), sorted(m._forward_hooks),
          sorted(m._forward_pre_hooks), m.training) for name, m in model.named_modules()],
        [(name, id(p)) for name, p in model.named_parameters()],
    )


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 32), nn.ReLU(), nn.Linear(32, 16))


def check_untouched_and_retry(model, before, error, hook_calls, hook):
    assert fingerprint(model) == before, f"model changed by a refused quantize ({error})"
    x = torch.randn(4, 40)
    expected = copy.deepcopy(model)(x)
    calls = len(hook_calls)
    # the user's hook still runs
    assert torch.equal(model(x), expected)
    assert len(hook_calls) == calls + 1
    mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    assert not torch.equal(model(x), expected)  # quantized now
    hook.remove()  # the user's handle still removes its hook
    calls = len(hook_calls)
    model(x)
    assert len(hook_calls) == calls


def with_user_hook(model):
    calls = []
    hook = model[0].register_forward_hook(lambda *_: calls.append(1))
    return calls, hook


def test_nvfp4_on_a_layer_whose_width_is_not_a_multiple_of_16_leaves_the_model_unquantized():
    model = make_model()
    calls, hook = with_user_hook(model)
    before = fingerprint(model)
    with pytest.raises(mtq.ConfigError) as error:
        mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, lambda m: m(torch.randn(4, 40)))
    check_untouched_and_retry(model, before, error.value, calls, hook)


def test_a_strict_config_with_a_rule_that_matches_nothing_leaves_the_model_unquantized():
    model = make_model()
    calls, hook = with_user_hook(model)
    before = fingerprint(model)
    config = {"quant_cfg": [{"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "axis": 0}},
                            {"quantizer_name": "*wieght_quantizer", "cfg": {"num_bits": 4}}],
              "algorithm": "max", "strict": True}
    with pytest.raises(mtq.ConfigError) as error:
        mtq.quantize(model, config, lambda m: m(torch.randn(4, 40)))
    check_untouched_and_retry(model, before, error.value, calls, hook)


@pytest.mark.parametrize("exception", [RuntimeError("data loader broke"), KeyboardInterrupt()])
def test_a_forward_loop_that_raises_leaves_the_model_unquantized(exception):
    model = make_model()
    calls, hook = with_user_hook(model)
    before = fingerprint(model)

    def forward_loop(m):
        m(torch.randn(4, 40))
        raise exception

    with pytest.raises(type(exception)) as error:
        mtq.quantize(model, mtq.INT8_DEFAULT_CFG, forward_loop)
    check_untouched_and_retry(model, before, error.value, calls, hook)
