"""Activation calibration over histograms (``algorithm: {"method": "histogram", ...}``) through ``mtq.quantize``:
Model Optimizer 0.47's ``HistogramCalibrator`` choices (tests/fixtures/modelopt_0_47/histogram_cases.pt, made by
tools/make_modelopt_histogram_fixture.py), several batches on one common range, each expert on its own tokens, and
configs it refuses."""

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

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "modelopt_0_47" / "histogram_cases.pt"


def model_and_data():
    """tools/make_modelopt_mse_fixture.py's model and calibration batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16))
    return model, torch.randn(32, 64, generator=torch.Generator().manual_seed(1))


def inputs_config(num_bits, algorithm: dict) -> dict:
    return {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                          {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": num_bits, "axis": None}}],
            "algorithm": copy.deepcopy(algorithm)}


@pytest.mark.parametrize("case", ["fp8_percentile_default", "fp8_percentile_99", "int8_percentile_99_9_256_bins",
                                  "fp8_mse_default", "int8_mse_default", "fp8_mse_256_bins_stride_3"])
def test_input_amaxes_are_model_optimizers_histogram_choices_bit_for_bit(case):
    fixture = torch.load(FIXTURE, weights_only=False)
    assert fixture["modelopt_version"] == "0.47.0"
    spec = fixture["cases"][case]
    model, data = model_and_data()
    mtq.quantize(model, inputs_config(spec["num_bits"], spec["algorithm"]), lambda m: m(data))
    for name, theirs in spec["amax"].items():
        layer = model[int(name.split(".")[0])]
        ours = layer.input_quantizer.amax
        assert ours.dtype == torch.float32
        assert torch.equal(ours.reshape(()), theirs.reshape(())), (name, ours, theirs)
        assert 0 < ours <= layer.input_quantizer.amax.new_tensor(1e9)
    maxed, _ = model_and_data()
    mtq.quantize(maxed, inputs_config(spec["num_bits"], {"method": "max"}), lambda m: m(data))
    assert any(not torch.equal(model[i].input_quantizer.amax, maxed[i].input_quantizer.amax) for i in (0, 2))


def test_several_batches_share_one_range_the_max_over_all_of_them():
    model, _ = model_and_data()
    batches = [torch.randn(16, 64) * s for s in (0.5, 1.0, 3.0)]  # the largest values in the last batch
    mtq.quantize(model, inputs_config((4, 3), {"method": "histogram", "percentile": 99.0, "num_bins": 512}),
                 lambda m: [m(b) for b in batches])
    amax = model[0].input_quantizer.amax
    values = torch.cat(batches).abs().reshape(-1)
    width = values.max() / 512
    # The left edge of the bin where 99% of the values are reached: fewer than 99% lie below it, 99% below the next.
    assert (values < amax).float().mean() < 0.99 <= (values < amax + width * 1.0001).float().mean()
    assert torch.allclose(amax / width, (amax / width).round(), atol=1e-3)  # an edge of the common range's bins


@pytest.mark.parametrize("layout", ["per_expert", "shared"])
@pytest.mark.parametrize("histogram_method", ["percentile", "mse"])
def test_each_expert_takes_the_amax_of_its_own_tokens_and_shared_of_all(layout, histogram_method):
    torch.manual_seed(0)
    experts = GroupedLinear(num_gemms=4, in_features=64, out_features=32)
    tokens = torch.randn(14, 64) * torch.tensor([0.5] * 3 + [1.0] * 4 + [4.0] * 5 + [1.0] * 2).unsqueeze(1)
    splits = [3, 4, 5, 2]
    algorithm = {"method": "histogram", "histogram_method": histogram_method, "num_bins": 256, "start_bin": 16,
                 "percentile": 90.0}
    config = {**inputs_config((4, 3), algorithm), "experts": {"input_amax": layout}}
    mtq.quantize(experts, config, lambda m: m(tokens, splits))
    amax = experts.input_quantizer.amax
    chunks = list(torch.split(tokens, splits))
    alone = []
    for chunk in chunks if layout == "per_expert" else [tokens]:
        plain = nn.Sequential(nn.Linear(64, 32))
        mtq.quantize(plain, inputs_config((4, 3), algorithm), lambda m, chunk=chunk: m(chunk))
        alone.append(plain[0].input_quantizer.amax.reshape(()))
    expected = torch.stack(alone) if layout == "per_expert" else alone[0].expand(4)
    assert torch.equal(amax.reshape(-1), expected)
    assert len(set(amax.reshape(-1).tolist())) == (4 if layout == "per_expert" else 1)


def test_an_expert_without_tokens_keeps_its_amax_and_nan_is_skipped(monkeypatch):
    monkeypatch.setattr("modelopt_moe.quantization.utils._warned", set())  # warn_once remembers messages per process
    torch.manual_seed(0)
    experts = GroupedLinear(num_gemms=3, in_features=16, out_features=8)
    tokens = torch.randn(6, 16)
    tokens[0, 0] = float("nan")
    config = {**inputs_config((4, 3), {"method": "histogram", "num_bins": 64, "percentile": 50.0}),
              "experts": {"input_amax": "per_expert"}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mtq.quantize(experts, config, lambda m: m(tokens, [3, 0, 3]))
    assert any("saw no calibration tokens" in str(w.message) for w in caught)
    amax = experts.input_quantizer.amax.reshape(-1)
    assert torch.isfinite(amax).all()
    assert amax[1] == tokens.nan_to_num(0).abs().max()  # the unseen expert: the shared (max) amax, untouched
    assert amax[0] < tokens[:3].nan_to_num(0).abs().max()
    assert amax[2] < tokens[3:].abs().max()


def test_mse_picks_the_bin_center_of_least_weighted_error():
    model, data = model_and_data()
    algorithm = {"method": "histogram", "histogram_method": "mse", "num_bins": 128, "start_bin": 8, "stride": 5}
    mtq.quantize(model, inputs_config((4, 3), algorithm), lambda m: m(data))
    values = data.abs().reshape(-1)
    edges = torch.linspace(0, float(values.max()), 129)
    centers = (edges[1:] + edges[:-1]) / 2
    counts = torch.histc(values, bins=128, min=0, max=float(values.max()))
    errors = [((fake_quant(centers, "e4m3", centers[i]) - centers) ** 2 * counts).mean() for i in range(8, 128, 5)]
    assert torch.equal(model[0].input_quantizer.amax.reshape(()), centers[8 + 5 * int(torch.stack(errors).argmin())])


def test_weights_and_blocked_activations_keep_max_calibration():
    model, data = model_and_data()
    config = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                            {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": (4, 3), "axis": None}},
                            {"quantizer_name": "*input_quantizer",
                             "cfg": {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic",
                                                                         "scale_bits": (4, 3)}}}],
              "algorithm": {"method": "histogram", "percentile": 50.0}}
    maxed = copy.deepcopy(model)
    mtq.quantize(model, config, lambda m: m(data))
    mtq.quantize(maxed, {**config, "algorithm": "max"}, lambda m: m(data))
    for ours, theirs in zip(model.state_dict().items(), maxed.state_dict().items(), strict=True):
        assert ours[0] == theirs[0]
        assert torch.equal(ours[1], theirs[1]), ours[0]


def test_configs_name_the_method_and_refuse_what_it_cannot_do():
    cfg = to_config({"algorithm": {"method": "histogram", "histogram_method": "mse", "num_bins": 512}})
    assert (cfg.algorithm, cfg.max_calib.histogram_method, cfg.max_calib.num_bins) == ("histogram", "mse", 512)
    again = to_config(cfg.model_dump())  # a dumped config keeps the method's options
    assert (again.algorithm, again.max_calib.histogram_method, again.max_calib.num_bins) == ("histogram", "mse", 512)
    assert to_config({"algorithm": "histogram"}).max_calib.percentile == 99.99  # Model Optimizer's defaults
    with pytest.raises(ConfigError, match=r"algorithm\.histogram_method='entropy' is not supported"):
        to_config({"algorithm": {"method": "histogram", "histogram_method": "entropy"}})
    with pytest.raises(ConfigError, match=r"algorithm\.start_bin=128 leaves no candidate among num_bins=64"):
        to_config({"algorithm": {"method": "histogram", "histogram_method": "mse", "num_bins": 64}})
    with pytest.raises(ConfigError, match=r"algorithm\.percentile=101"):
        to_config({"algorithm": {"method": "histogram", "percentile": 101}})
    with pytest.raises(ConfigError, match=r"calibrator='histogram'.*algorithm \{'method': 'histogram'"):
        to_config({"quant_cfg": [{"quantizer_name": "*input_quantizer", "cfg": {"calibrator": "histogram"}}]})


def test_a_failing_second_pass_puts_every_quantizer_back():
    model, data = model_and_data()
    mtq.quantize(model, inputs_config((4, 3), {"method": "max"}), lambda m: m(data))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def loop(m):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("data source closed")
        m(data)

    with pytest.raises(RuntimeError, match="data source closed"):
        mtq.calibrate(model, {"method": "histogram"}, loop)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(q.calib_observer is None for _, q, _ in mtq.named_quantizers(model))
    assert torch.equal(model(data), model(data))
