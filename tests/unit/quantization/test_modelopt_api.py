"""A Model Optimizer 0.47 user's calls, with ``import modelopt_moe.quantization as mtq`` and
``import modelopt_moe.checkpoint as mto`` in place of NVIDIA Model Optimizer's: the ``mtq`` functions, TensorQuantizer
as their code uses it, and the sharp edges a new user hits (each with the error or warning they now get)."""

import copy
import textwrap
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

import modelopt_moe.checkpoint as mto
import modelopt_moe.quantization as mtq
from modelopt_moe.numerics import fake_quant
from modelopt_moe.quantization import utils as qutils
from modelopt_moe.quantization.config import ConfigError, QuantizerAttributeConfig, load_config
from modelopt_moe.quantization.nn import GroupedLinear
from modelopt_moe.quantization.tensor_quantizer import TensorQuantizer

FP8 = {"num_bits": (4, 3), "axis": None}
INT8_W = {"num_bits": 8, "axis": 0}


def model(seed=0, widths=(128, 32, 16, 8)):
    torch.manual_seed(seed)
    layers = OrderedDict()
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers[f"fc{i + 1}"] = nn.Linear(a, b)
        if i < len(widths) - 2:
            layers[f"act{i + 1}"] = nn.ReLU()
    return nn.Sequential(layers)


def batches(n=2, width=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, width, generator=g) for _ in range(n)]


def loop(data):
    return lambda m: [m(x) for x in data]


def config(*entries, **top):
    return {"quant_cfg": [{"quantizer_name": "*", "enable": False}, *entries], "algorithm": "max", **top}


@pytest.fixture(autouse=True)
def _fresh_warnings():
    qutils._warned.clear()  # warn_once remembers messages per process


# ------------------------------------------------------------------------------------------------------ mtq verbs


def test_forward_loop_without_an_argument_is_accepted():
    data = batches()
    a, b = model(), model()
    mtq.quantize(a, config({"quantizer_name": "*input_quantizer", "cfg": FP8}), loop(data))
    mtq.quantize(b, config({"quantizer_name": "*input_quantizer", "cfg": FP8}), lambda: [b(x) for x in data])
    assert torch.equal(a.fc1.input_quantizer.amax, b.fc1.input_quantizer.amax)


def test_set_quantizer_by_cfg_changes_only_matched_quantizers_in_order():
    m = mtq.quantize(model(), config({"quantizer_name": "*weight_quantizer", "cfg": FP8}), loop(batches()))
    amax = m.fc2.weight_quantizer.amax.clone()
    mtq.set_quantizer_by_cfg(m, [{"quantizer_name": "fc1.weight_quantizer", "cfg": INT8_W},
                                 {"quantizer_name": "fc3.*", "enable": False},
                                 {"quantizer_name": "fc2.input_quantizer", "enable": True}])
    assert m.fc1.weight_quantizer.fmt == "int8"
    assert m.fc1.weight_quantizer.axis == 0
    # untouched
    assert m.fc2.weight_quantizer.fmt == "e4m3"
    assert torch.equal(m.fc2.weight_quantizer.amax, amax)
    # enable-only keeps format
    assert not m.fc3.weight_quantizer.is_enabled
    assert m.fc3.weight_quantizer.fmt == "e4m3"
    assert m.fc2.input_quantizer.is_enabled
    # The legacy dict form too.
    mtq.set_quantizer_by_cfg(m, {"*input_quantizer": {"enable": False}})
    assert not m.fc2.input_quantizer.is_enabled


def test_set_quantizer_attributes_full_partial_and_deprecated_single():
    m = mtq.quantize(model(), config({"quantizer_name": "*weight_quantizer", "cfg": INT8_W}), loop(batches()))
    n = mtq.set_quantizer_attributes_partial(m, "*fc1.weight_quantizer", {"narrow_range": True})
    # the rest kept
    assert n == 1
    assert m.fc1.weight_quantizer.narrow_range
    assert m.fc1.weight_quantizer.axis == 0
    mtq.set_quantizer_attributes_full(m, lambda name: name.startswith("fc2."), QuantizerAttributeConfig(num_bits=4))
    # defaults, not kept
    assert m.fc2.weight_quantizer.fmt == "int4"
    assert m.fc2.weight_quantizer.axis is None
    assert m.fc2.input_quantizer.is_enabled  # full replacement: enabled by default
    with pytest.warns(DeprecationWarning, match="set_quantizer_attributes_partial"):
        mtq.set_quantizer_attribute(m, "*fc3.weight_quantizer", {"enable": False})
    assert not m.fc3.weight_quantizer.is_enabled
    assert mtq.set_quantizer_attributes_partial(m, "*", {"enable": True}, parent_class="nn.Linear") == 9
    with pytest.raises(ConfigError, match="unknown quantizer attributes"):
        mtq.set_quantizer_attributes_partial(m, "*", {"num_bit": 4})


def test_enable_and_disable_quantizer_by_wildcard_or_filter_function():
    m = mtq.quantize(model(), mtq.FP8_DEFAULT_CFG, loop(batches()))
    assert mtq.disable_quantizer(m, lambda name: "fc2" in name) == 3
    assert not m.fc2.weight_quantizer.is_enabled
    assert m.fc1.weight_quantizer.is_enabled
    assert mtq.enable_quantizer(m, "*fc2.weight_quantizer") == 1
    assert m.fc2.weight_quantizer.is_enabled
    with pytest.raises(TypeError, match="wildcard string or a filter function"):
        mtq.disable_quantizer(m, 3)


def test_postprocess_amax_applies_once_per_amax():
    m = mtq.quantize(model(), mtq.INT8_DEFAULT_CFG, loop(batches()))
    before = m.fc1.weight_quantizer.amax.clone()
    mtq.postprocess_amax(m, "*weight_quantizer", lambda a: a * 0.5)
    assert torch.equal(m.fc1.weight_quantizer.amax, before * 0.5)
    # Expert quantizers: the whole [N] amax, or the per-expert entries, never both.
    g = GroupedLinear(3, 16, 8)
    cfg = {**mtq.FP8_DEFAULT_CFG, "experts": {"weight_amax": "per_expert"}}
    mtq.quantize(g, cfg, lambda mod: mod(torch.randn(6, 16), [2, 2, 2]))
    w = g.weight_quantizer.amax.clone()
    mtq.postprocess_amax(g, "weight_quantizer*", lambda a: a * 2)
    assert torch.equal(g.weight_quantizer.amax, w * 2)
    mtq.postprocess_amax(g, "weight_quantizer.1", lambda a: a * 0 + 7)
    assert g.weight_quantizer.amax.tolist() == [w[0] * 2, 7.0, w[2] * 2]


def test_replace_quant_module_then_set_quantizer_by_cfg_then_calibrate(capsys):
    m = model()
    mtq.replace_quant_module(m)
    assert "Inserted 9 quantizers" in capsys.readouterr().out
    assert all(q.is_enabled and q.fmt == "int8" for _, q, _ in mtq.named_quantizers(m))  # Model Optimizer's defaults
    mtq.set_quantizer_by_cfg(m, mtq.FP8_DEFAULT_CFG["quant_cfg"])
    mtq.calibrate(m, {"method": "max"}, loop(batches()))
    reference = mtq.quantize(model(), mtq.FP8_DEFAULT_CFG, loop(batches()))
    for (name, q), (_, r) in zip(((n, q) for n, q, _ in mtq.named_quantizers(m)),
                                 ((n, q) for n, q, _ in mtq.named_quantizers(reference)), strict=True):
        assert q.is_enabled == r.is_enabled, name
        assert q.amax is None or torch.equal(q.amax, r.amax), name
    with pytest.raises(ValueError, match="already quantized"):
        mtq.replace_quant_module(m)


def test_print_quant_summary_to_a_directory_and_fold_weight_keep_attrs(tmp_path, capsys):
    m = mtq.quantize(model(), mtq.INT8_DEFAULT_CFG, loop(batches()))
    text = mtq.print_quant_summary(m, output_dir=str(tmp_path))
    assert (tmp_path / ".quant_summary.txt").read_text().strip() == text
    assert "Quant summary saved" in capsys.readouterr().out
    expected = fake_quant(m.fc1.weight.detach(), "int8", m.fc1.weight_quantizer.amax, narrow_range=False)
    mtq.fold_weight(m, keep_attrs=True)
    assert torch.equal(m.fc1.weight.detach(), expected)
    assert not m.fc1.weight_quantizer.is_enabled
    assert m.fc1.weight_quantizer.amax is not None


def test_algorithm_as_a_dict_and_its_options():
    m = model()
    data = batches()
    calls = []
    cfg = config({"quantizer_name": "*weight_quantizer", "cfg": FP8},
                 algorithm={"method": "max", "skip_forward_without_activation_calib": True, "distributed_sync": False})
    mtq.quantize(m, cfg, lambda mod: calls.append(1))
    assert not calls  # weight-only: no forward needed, none run
    assert to_cfg(cfg).max_calib.distributed_sync is False
    mtq.quantize(model(), config({"quantizer_name": "*input_quantizer", "cfg": FP8},
                                 algorithm={"method": "max", "skip_forward_without_activation_calib": True}),
                 lambda mod: calls.append(mod(data[0])))
    assert calls  # an activation quantizer needs data
    with pytest.raises(ConfigError, match=r"algorithm='awq_lite'.*docs/modelopt_compat\.md"):
        mtq.quantize(model(), {**mtq.FP8_DEFAULT_CFG, "algorithm": "awq_lite"})
    # Model Optimizer's one weight amax for all experts is the `shared` expert layout.
    synced = config({"quantizer_name": "*weight_quantizer", "cfg": FP8},
                    algorithm={"method": "max", "sync_expert_weight_amax": True})
    assert to_cfg(synced).experts.weight_amax == "shared"
    with pytest.raises(ConfigError, match="sync_expert_weight_amax"):
        to_cfg({**synced, "experts": {"weight_amax": "per_expert"}})


def to_cfg(c):
    from modelopt_moe.quantization.config import to_config

    return to_config(copy.deepcopy(c))


@pytest.mark.parametrize(("attrs", "key"), [
    ({"num_bits": 8, "fake_quant": False}, "fake_quant"),
    ({"num_bits": 8, "calibrator": "histogram"}, "calibrator"),
    ({"num_bits": 8, "bias": {-1: None, "type": "static"}}, "bias"),
    ({"num_bits": 8, "rotate": True}, "rotate"),
    ({"num_bits": 8, "backend": "my_backend"}, "backend"),
    ({"num_bits": 8, "constant_amax": 448.0}, "constant_amax"),
    ({"num_bits": 4, "block_sizes": {-1: 128, -2: 128}}, "block_sizes"),
    ({"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "static", "scale_block_sizes": {-1: 16}}},
     "block_sizes.scale_block_sizes"),
])
def test_model_optimizer_features_we_do_not_have_name_the_key_and_the_doc(attrs, key):
    with pytest.raises(ConfigError) as e:
        mtq.quantize(model(), config({"quantizer_name": "*weight_quantizer", "cfg": attrs}))
    assert key in str(e.value)
    assert "docs/modelopt_compat.md" in str(e.value)


def test_sequential_quantizer_cfg_list_is_a_documented_difference():
    with pytest.raises(ConfigError, match=r"SequentialQuantizer.*docs/modelopt_compat\.md"):
        to_cfg(config({"quantizer_name": "*weight_quantizer", "cfg": [{"num_bits": 4}, {"num_bits": (4, 3)}]}))


def test_unknown_keys_still_fail_naming_the_key():
    with pytest.raises(ConfigError, match="unknown key 'num_bit'.*did you mean 'num_bits'"):
        to_cfg(config({"quantizer_name": "*weight_quantizer", "cfg": {"num_bit": 8}}))
    with pytest.raises(ConfigError, match="unknown key 'algorithmm'"):
        to_cfg({"quant_cfg": [], "algorithmm": "max"})


# ------------------------------------------------------------------------------------------------ TensorQuantizer


def test_tensor_quantizer_constructor_like_model_optimizer():
    q = TensorQuantizer({"num_bits": 8, "axis": 0}, if_quant=False, if_calib=True)
    x = torch.randn(4, 16) * torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    assert q(x) is x
    q.load_calib_amax()
    assert torch.equal(q.amax, x.abs().amax(1, keepdim=True))
    q.disable_calib()
    q.enable_quant()
    assert torch.equal(q(x), fake_quant(x, "int8", q.amax, narrow_range=False))
    q2 = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3)), amax=2.5)
    assert q2.amax.item() == 2.5
    assert q2.amax.dtype == torch.float32


def test_load_calib_amax_without_data_is_strict_unless_told():
    q = TensorQuantizer(if_quant=False, if_calib=True)
    with pytest.raises(RuntimeError, match="has not seen any tensor"):
        q.load_calib_amax()
    with pytest.warns(UserWarning, match="NaN"):
        q.load_calib_amax(strict=False)
    assert torch.isnan(q.amax)


def test_load_calib_amax_of_static_int4_blocks_padded_to_128_on_a_16_wide_input():
    q = TensorQuantizer({"num_bits": 4, "block_sizes": {-1: 128, "type": "static"}}, if_quant=False, if_calib=True)
    x = torch.randn(8, 16)
    q(x)
    q.load_calib_amax()
    assert q.amax.shape == (8, 1)
    assert torch.equal(q.amax, x.abs().amax(1, keepdim=True))
    q.disable_calib()
    q.enable_quant()
    out = q(x)
    padded = torch.nn.functional.pad(x, (0, 112))
    assert out.shape == x.shape
    assert torch.equal(out, fake_quant(padded, "int4", q.amax, narrow_range=False)[:, :16])
    with pytest.raises(ValueError, match="needs the input shape it was calibrated on"):
        q(torch.randn(4, 16))


def test_step_size_and_the_num_bits_unsigned_narrow_range_setters():
    q = TensorQuantizer({"num_bits": 8}, amax=2.54)
    assert torch.allclose(q.step_size, torch.tensor(2.54 / 127))
    q.num_bits = 4
    assert q.fmt == "int4"
    assert torch.allclose(q.step_size, torch.tensor(2.54 / 7))
    q.unsigned = True
    assert q.maxbound == 15
    assert torch.allclose(q.step_size, torch.tensor(2.54 / 15))
    x = torch.tensor([-1.0, 0.5, 3.0])
    assert torch.equal(q(x), fake_quant(x, "int4", q.amax, unsigned=True))
    q.narrow_range = True
    assert q.cfg.narrow_range
    with pytest.raises(ValueError, match="integer formats only"):
        _ = TensorQuantizer({"num_bits": (4, 3)}, amax=1.0).step_size
    with pytest.raises(ValueError, match="unsigned"):
        q.num_bits = (4, 3)  # unsigned applies to int formats only


def test_get_and_set_from_modelopt_state_round_trip():
    q = TensorQuantizer({"num_bits": 4, "block_sizes": {-1: 128, "type": "static"}}, if_calib=True)
    q(torch.randn(3, 256))
    state = q.get_modelopt_state()
    assert state["_num_bits"] == 4
    assert state["_block_sizes"] == {-1: 128, "type": "static"}
    assert state["_pytorch_state_metadata"]["buffers"]["_amax"]["shape"] == torch.Size([6, 1])
    fresh = TensorQuantizer()
    fresh.set_from_modelopt_state(state)
    assert fresh.static_block_size == 128
    assert fresh.amax.shape == (6, 1)
    assert fresh._if_calib
    with pytest.raises(ValueError, match=r"_rotate.*docs/modelopt_compat\.md"):
        fresh.set_from_modelopt_state({**state, "_rotate": True})


# ----------------------------------------------------------------------------------------------------- sharp edges


def test_unmatched_pattern_warns_with_the_closest_names_and_strict_makes_it_an_error():
    cfg = config({"quantizer_name": "*wieght_quantizer", "cfg": FP8}, {"quantizer_name": "*router*", "enable": False})
    with pytest.warns(UserWarning, match=r"'\*wieght_quantizer' matches no quantizer; closest names: \['fc1\.weig"):
        mtq.quantize(model(), cfg, loop(batches()))
    with pytest.raises(ConfigError, match=r"\*wieght_quantizer.*closest names"):
        mtq.quantize(model(), {**cfg, "strict": True}, loop(batches()))
    # Disable-only entries (exclusion lists written for many models, like Model Optimizer's presets) stay quiet.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mtq.quantize(model(), mtq.FP8_DEFAULT_CFG, loop(batches()))
    with pytest.warns(UserWarning, match="parent_class 'nn.Conv2d' none of their modules"):
        mtq.quantize(model(), config({"quantizer_name": "*weight_quantizer", "parent_class": "nn.Conv2d",
                                      "cfg": FP8}))


def test_shipped_int4_preset_pads_the_last_dim_and_runs():
    m = model(widths=(64, 96, 16))  # inputs of 64 and 96: neither a multiple of the 128-element blocks
    mtq.quantize(m, mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, loop(batches(width=64)))
    y = m(torch.randn(4, 64))
    assert torch.isfinite(y).all()
    w = m.fc1.weight.detach()
    assert torch.equal(m.fc1.weight_quantizer(w), fake_quant(w, "int4", None, 128, narrow_range=False))


def test_what_cannot_work_fails_when_quantize_configures_naming_the_module():
    m = model(widths=(24, 32, 8))  # fc1's inputs: 24, not a multiple of NVFP4's 16
    with pytest.raises(ConfigError, match=r"fc1\.weight_quantizer: NVFP4.*last dim, which is 24.*\(32, 24\)"):
        mtq.quantize(m, mtq.NVFP4_DEFAULT_CFG, loop(batches(width=24)))
    g = GroupedLinear(2, 16, 8)
    with pytest.raises(ConfigError, match=r"^weight_quantizer: .*expert block_sizes.*type: dynamic"):
        mtq.quantize(g, {**mtq.INT8_DEFAULT_CFG, "quant_cfg": [
            {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 4, "block_sizes": {-1: 128}}}]})


def test_imports_and_load_config_find_the_shipped_presets_by_bare_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # anywhere: no configs/ directory here
    assert load_config("nvfp4_default").model_dump() == load_config("nvfp4_default.yaml").model_dump()
    assert load_config("NVFP4_DEFAULT_CFG").model_dump() == mtq.NVFP4_DEFAULT_CFG
    mine = tmp_path / "mine.yaml"
    mine.write_text(textwrap.dedent("""\
        $import: nvfp4_default.yaml
        quant_cfg:
          - $import: fp8_default
        experts: {weight_amax: per_expert}
        """))
    cfg = load_config(mine)
    assert cfg.experts.weight_amax == "per_expert"
    assert cfg.resolve("fc.weight_quantizer", ("Linear",)).format == "e4m3"  # the spliced FP8 entries come later
    with pytest.raises(ConfigError, match="shipped presets .*nvfp4_default"):
        load_config("nvfp4_defualt")
    (tmp_path / "fp8_default.yaml").write_text("quant_cfg: [{quantizer_name: '*', enable: false}]\n")
    assert len(load_config(mine).quant_cfg) < len(cfg.quant_cfg)  # a file beside mine.yaml comes first


def test_forward_loop_that_is_not_callable_is_a_clear_error_before_anything_changes():
    m = model()
    with pytest.raises(TypeError, match=r"forward_loop must be a callable .*got a list.*lambda model"):
        mtq.quantize(m, mtq.FP8_DEFAULT_CFG, batches())
    assert not any(isinstance(x, TensorQuantizer) for x in m.modules())  # the model was not converted
    with pytest.raises(TypeError, match="requires 2 arguments"):
        mtq.quantize(m, mtq.FP8_DEFAULT_CFG, lambda model, data: None)


def test_second_quantize_on_a_quantized_model_is_an_error_naming_the_alternative():
    m = mtq.quantize(model(), mtq.FP8_DEFAULT_CFG, loop(batches()))
    amax = m.fc1.input_quantizer.amax.clone()
    with pytest.raises(ValueError, match=r"already quantized.*set_quantizer_by_cfg.*calibrate.*modelopt_compat"):
        mtq.quantize(m, mtq.INT8_DEFAULT_CFG, loop(batches()))
    # unchanged
    assert m.fc1.input_quantizer.fmt == "e4m3"
    assert torch.equal(m.fc1.input_quantizer.amax, amax)


def test_after_forward_loop_raises_the_model_is_as_before_calibration():
    def failing(m):
        m(batches()[0])
        raise RuntimeError("data loader died")

    m = model()
    m.train()
    with pytest.raises(RuntimeError, match="data loader died") as e:
        mtq.quantize(m, mtq.FP8_DEFAULT_CFG, failing)
    assert any("back as it was before this call" in note for note in getattr(e.value, "__notes__", []))
    # Not converted at all (mtq.quantize is all or nothing), training mode kept.
    assert not list(mtq.named_quantizers(m))
    assert type(m.fc1) is torch.nn.Linear
    assert m.training
    # Then quantize again.
    mtq.quantize(m, mtq.FP8_DEFAULT_CFG, loop(batches()))
    assert m.fc1.input_quantizer.amax is not None
    # A calibrated model that fails a re-calibration keeps its amaxes.
    amax = m.fc1.input_quantizer.amax.clone()
    with pytest.raises(RuntimeError):
        mtq.calibrate(m, "max", failing)
    assert torch.equal(m.fc1.input_quantizer.amax, amax)
    assert not m.fc1.input_quantizer._if_calib


# -------------------------------------------------------------------------------------------------------- experts


def test_expert_quantizers_take_narrow_range_and_dynamic_amaxes():
    g = GroupedLinear(3, 16, 8)
    cfg = {"quant_cfg": [{"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8}},
                         {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": (4, 3), "type": "dynamic"}}],
           "kernel": "torch"}
    x = torch.randn(6, 16)
    mtq.quantize(g, cfg, lambda mod: mod(x, [2, 2, 2]))
    assert g.input_quantizer.amax is None
    assert g.input_quantizer.is_dynamic
    w = g.weight0.detach()
    assert torch.equal(g.weight_quantizer.fake_quant_expert(0, w),
                       fake_quant(w, "int8", g.weight_quantizer.expert_amax(0), narrow_range=False))
    xs = x[:2]
    assert torch.equal(g.input_quantizer.fake_quant_expert(0, xs), fake_quant(xs, "e4m3", xs.abs().amax()))


def test_restore_from_modelopt_state_takes_our_state_too(tmp_path):
    m = mtq.quantize(model(), mtq.INT8_DEFAULT_CFG, loop(batches()))
    state = mto.modelopt_state(m)
    fresh = mto.restore_from_modelopt_state(model(seed=3), state)
    fresh.load_state_dict(m.state_dict())
    x = torch.randn(2, 128)
    assert torch.equal(fresh(x), m(x))


def test_dynamic_per_token_input_quantizer_with_a_tuple_axis():
    # Model Optimizer's per-token activations of [batch, tokens, hidden]: keep axes (0, 1), amax of each token.
    cfg = config({"quantizer_name": "*input_quantizer", "cfg": {"num_bits": (4, 3), "type": "dynamic",
                                                                  "axis": (0, 1)}})
    m = mtq.quantize(model(), cfg, loop(batches()))
    q = m.fc1.input_quantizer
    x = torch.randn(2, 5, 128)
    assert q.is_dynamic
    assert q.amax is None
    assert torch.equal(q(x), fake_quant(x, "e4m3", x.abs().amax(-1, keepdim=True)))
    with pytest.raises(ValueError, match="dynamic quantizer"):
        q.load_calib_amax()


@pytest.mark.parametrize("bits", [2, 3, 5, 6, 7])
def test_any_integer_width_from_two_to_eight_bits_as_model_optimizer_takes_it(bits):
    # Model Optimizer's own unit tests set e.g. ``quantizer.num_bits = 7``; its levels are [-2**(b-1), 2**(b-1)-1].
    m = nn.Sequential(nn.Linear(64, 32))
    x = torch.randn(8, 64)
    config = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                            {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "axis": 0}}]}
    mtq.quantize(m, config, lambda mod: mod(x))
    q = m[0].weight_quantizer
    q.num_bits = bits
    w = m[0].weight.detach()
    scale = (2 ** (bits - 1) - 1) / q.amax
    levels = torch.round(q(w) * scale)
    assert torch.equal(levels, torch.clamp(torch.round(w * scale), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1))
    assert levels.unique().numel() <= 2 ** bits
