"""The weight MSE search (``algorithm: {"method": "mse", ...}``) through ``mtq.quantize``: Model Optimizer 0.47's
choices (tests/fixtures/modelopt_0_47/mse_cases.pt, made by tools/make_modelopt_mse_fixture.py), a brute-force
reference over the grid, each expert of an expert quantizer searched as its own tensor, and configs it refuses."""

import copy
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import modelopt_moe.quantization as mtq
from modelopt_moe.numerics import fake_quant
from modelopt_moe.quantization.config import ConfigError, to_config
from modelopt_moe.quantization.nn import GroupedLinear

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "modelopt_0_47" / "mse_cases.pt"
GRID = torch.linspace(0.25, 4.0, 39)  # Model Optimizer's default: ceil((4 - 0.25) / 0.1) + 1 candidates


@pytest.fixture(scope="module")
def fixture():
    return torch.load(FIXTURE, weights_only=False)


def quantize(model, config, data):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mtq.quantize(model, {**copy.deepcopy(config), "weight_amax_update": "static"}, lambda m: m(data))


@pytest.mark.parametrize("case", ["fp8_per_tensor", "fp8_per_channel", "int8_per_channel",
                                  "int8_per_tensor_coarse_grid", "int4_static_blocks"])
def test_weight_amaxes_are_model_optimizers_mse_choices_bit_for_bit(fixture, case):
    assert fixture["modelopt_version"] == "0.47.0"
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16))
    model.load_state_dict(fixture["model_state"])
    quantize(model, fixture["cases"][case]["config"], fixture["calib"])
    ours = {k: v for k, v in model.state_dict().items() if k.endswith("_amax")}
    theirs = fixture["cases"][case]["amax"]
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert ours[key].dtype == torch.float32
        assert torch.equal(ours[key], value.reshape(ours[key].shape)), key
    if case == "int8_per_tensor_coarse_grid":
        return  # its grid holds 1.0, which both layers choose
    # The search moved at least one weight amax off max calibration's value.
    maxed = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16))
    maxed.load_state_dict(fixture["model_state"])
    config = {**fixture["cases"][case]["config"], "algorithm": "max"}
    quantize(maxed, config, fixture["calib"])
    weights = {k: v for k, v in maxed.state_dict().items() if k.endswith("weight_quantizer._amax")}
    assert any(not torch.equal(ours[k], v) for k, v in weights.items())


def reference_search(weight: torch.Tensor, amax: torch.Tensor, fmt: str, grid=GRID) -> torch.Tensor:
    """The amax of least squared error among ``amax * m`` (the first of equal errors), per amax entry."""
    errors = torch.stack([((weight - fake_quant(weight, fmt, amax * m)) ** 2).sum(dim=-1, keepdim=amax.dim() > 0)
                          if amax.dim() else ((weight - fake_quant(weight, fmt, amax * m)) ** 2).sum() for m in grid])
    return amax * grid[errors.argmin(dim=0)].reshape(amax.shape)


@pytest.mark.parametrize("axis", [None, 0])
@pytest.mark.parametrize("layout", ["vectorized", "per_expert", "shared"])
def test_each_expert_is_searched_like_its_own_tensor_and_shared_on_the_summed_error(axis, layout):
    torch.manual_seed(0)
    experts = GroupedLinear(num_gemms=4, in_features=64, out_features=32)
    with torch.no_grad():
        for i, w in enumerate(experts.expert_weights()):
            w.mul_(4.0**i)  # a distinct magnitude per expert: a wrong expert index cannot pass
    weights = [w.detach().clone() for w in experts.expert_weights()]
    config = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                            {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": (4, 3), "axis": axis}}],
              "algorithm": "mse", "experts": {"weight_amax": layout}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(experts, {**config, "weight_amax_update": "static"}, lambda m: m(torch.randn(8, 64), [2, 2, 2, 2]))
    amax = experts.weight_quantizer.amax
    for i, w in enumerate(weights):
        own = w.abs().amax() if axis is None else w.abs().amax(dim=1, keepdim=True)
        if layout != "shared":
            assert torch.equal(amax[i].reshape(own.shape), reference_search(w, own, "e4m3")), i
    if layout == "shared":
        own = torch.stack([w.abs().amax() if axis is None else w.abs().amax(dim=1) for w in weights]).amax(dim=0)
        rows = own if axis is None else own.unsqueeze(-1)
        errors = torch.stack([sum(((w - fake_quant(w, "e4m3", rows * m)) ** 2).sum(dim=-1) if axis == 0 else
                                  ((w - fake_quant(w, "e4m3", rows * m)) ** 2).sum() for w in weights)
                              for m in GRID])
        best = own * GRID[errors.argmin(dim=0)]
        assert torch.equal(amax, best.expand_as(amax))


def test_with_1_on_its_grid_the_search_never_raises_the_weight_error_above_max_calibrations():
    # Model Optimizer's default grid (0.25 to 4 in 39 steps of 0.0987) does not hold 1.0, so its choice can be worse
    # than max (docs/calibration.md); 0.25 to 4 in steps of 0.125 holds it exactly.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 64))
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.weight.copy_(torch.randn_like(layer.weight) * 0.02)  # bell-shaped, as trained weights are
    errors = {}
    for method in ("max", "mse"):
        m = copy.deepcopy(model)
        config = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                                {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 4, "axis": 0}}],
                  "algorithm": {"method": method, **({"step_size": 0.125} if method == "mse" else {})}}
        quantize(m, config, torch.randn(4, 256))
        errors[method] = [((layer.weight - layer.weight_quantizer(layer.weight)) ** 2).sum().item()
                          for layer in (m[0], m[2])]
    assert all(mse <= mx for mse, mx in zip(errors["mse"], errors["max"], strict=True))
    assert sum(errors["mse"]) < sum(errors["max"])


def test_nvfp4_weights_and_activations_keep_max_calibration():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32))
    data = torch.randn(8, 64)
    results = []
    for method in ("max", "mse"):
        m = copy.deepcopy(model)
        config = {**copy.deepcopy(mtq.NVFP4_DEFAULT_CFG), "algorithm": method}
        quantize(m, config, data)
        results.append({k: v for k, v in m.state_dict().items() if k.endswith("_amax")})
    assert results[0].keys() == results[1].keys()
    assert results[0]
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_configs_name_the_method_and_refuse_what_it_cannot_do():
    cfg = to_config({"algorithm": {"method": "mse", "step_size": 0.2}, "weight_amax_update": "static"})
    assert (cfg.algorithm, cfg.max_calib.step_size, cfg.max_calib.start_multiplier) == ("mse", 0.2, 0.25)  # noqa: PT018
    again = to_config(cfg.model_dump())  # a dumped config (e.g. a preset dict) keeps the method's options
    assert (again.algorithm, again.max_calib.step_size) == ("mse", 0.2)
    back = to_config({**cfg.model_dump(), "algorithm": "max"})
    assert back.algorithm == "max"
    assert not hasattr(back.max_calib, "step_size")
    assert to_config({}).algorithm == "max"
    with pytest.raises(ConfigError, match="weight_amax_update=dynamic"):
        to_config({"algorithm": "mse"})  # dynamic (the default) would replace the searched amaxes
    assert to_config({"algorithm": {"method": "mse", "fp8_scale_sweep": True},
                      "weight_amax_update": "static"}).max_calib.fp8_scale_sweep  # static NVFP4 block scales
    with pytest.raises(ConfigError, match="stop_multiplier"):
        to_config({"algorithm": {"method": "mse", "start_multiplier": 2.0, "stop_multiplier": 1.0},
                   "weight_amax_update": "static"})
    with pytest.raises(ConfigError, match=r"'gptq'.*\['histogram', 'max', 'mse'\]"):
        to_config({"algorithm": "gptq"})
    with pytest.raises(ConfigError, match=r"'mystery'.*\['histogram', 'max', 'mse'\]"):
        to_config({"algorithm": {"method": "mystery"}})
    with pytest.raises(ConfigError, match=r"algorithm\.step_sizee: unknown option of method 'mse' \(did you mean "
                                          r"'step_size'\?\)"):
        to_config({"algorithm": {"method": "mse", "step_sizee": 0.2}, "weight_amax_update": "static"})


def test_every_registered_calibrator_has_its_options_and_the_reverse():
    from modelopt_moe.quantization.calib.registry import CALIBRATORS
    from modelopt_moe.quantization.config_schema import CALIBRATION_OPTIONS

    assert sorted(CALIBRATORS) == sorted(CALIBRATION_OPTIONS)
    for name, calibrator in CALIBRATORS.items():
        assert calibrator.name == name
        assert calibrator.options is CALIBRATION_OPTIONS[name]


def test_calibrate_mse_on_a_model_with_dynamic_weight_amaxes_warns_that_they_will_be_replaced():
    model = nn.Sequential(nn.Linear(32, 16))
    data = torch.randn(4, 32)
    mtq.quantize(model, copy.deepcopy(mtq.INT8_DEFAULT_CFG), lambda m: m(data))  # weight_amax_update: dynamic
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mtq.calibrate(model, {"method": "mse", "step_size": 0.5}, lambda m: m(data))
    assert any("weight_amax_update=dynamic recomputes" in str(w.message) for w in caught), caught


def test_mtq_calibrate_names_a_bad_option_of_the_method():
    model = nn.Sequential(nn.Linear(8, 4))
    mtq.quantize(model, copy.deepcopy(mtq.INT8_DEFAULT_CFG), None)
    with pytest.raises(ValueError, match=r"algorithm\.stop_multiplierr: unknown option of method 'mse'"):
        mtq.calibrate(model, {"method": "mse", "stop_multiplierr": 2.0})
