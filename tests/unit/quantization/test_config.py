"""Configs (modelopt_moe/quantization/config.py, configs/*.yaml): presets, rule order, YAML ``$import``, and
errors that name the file, the key and the bad value."""

import copy
import textwrap

import pytest

import modelopt_moe.quantization as mtq
from modelopt_moe.quantization.config import (
    BackwardConfig,
    ConfigError,
    QuantizeConfig,
    QuantizerAttributeConfig,
    load_config,
    to_config,
)

PRESETS = {
    "FP8_DEFAULT_CFG": ("e4m3", "e4m3", None),
    "NVFP4_DEFAULT_CFG": ("nvfp4", "nvfp4", None),
    "INT8_DEFAULT_CFG": ("int8", "int8", 0),
    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG": ("int4", None, None),
}


def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


# --------------------------------------------------------------------------------------------------------------
# Presets


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_validates_and_resolves_weight_and_input_formats(name):
    preset = getattr(mtq, name)
    assert isinstance(preset, dict)
    cfg = to_config(copy.deepcopy(preset))
    assert isinstance(cfg, QuantizeConfig)
    w_fmt, in_fmt, w_axis = PRESETS[name]
    w = cfg.resolve("decoder.layers.0.mlp.linear_fc1.weight_quantizer", "Linear")
    assert w.enable
    assert w.format == w_fmt
    assert w.axis == w_axis
    i = cfg.resolve("decoder.layers.0.mlp.linear_fc1.input_quantizer", "Linear")
    if in_fmt is None:
        assert i is not None
        assert not i.enable
    else:
        assert i.enable
        assert i.format == in_fmt
    # Output quantizers are off in every preset.
    assert not cfg.resolve("decoder.layers.0.mlp.linear_fc1.output_quantizer", "Linear").enable


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_default_tail_disables_router_and_output_layer_in_every_preset(name):
    cfg = to_config(getattr(mtq, name))
    for quantizer in ("weight_quantizer", "input_quantizer"):
        assert not cfg.resolve(f"decoder.layers.3.mlp.router.{quantizer}", "TopKRouter").enable
        assert not cfg.resolve(f"output_layer.{quantizer}", "ColumnParallelLinear").enable
        assert not cfg.resolve(f"lm_head.{quantizer}", "Linear").enable


def test_preset_details():
    nvfp4 = to_config(mtq.NVFP4_DEFAULT_CFG).resolve("fc.weight_quantizer", "Linear")
    # NVFP4's 16 is implied, not an int block
    assert nvfp4.block_sizes[-1] == 16
    assert nvfp4.block_size is None
    int4 = to_config(mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG).resolve("fc.weight_quantizer", "Linear")
    assert int4.block_size == 128
    assert int4.axis is None
    fp8 = to_config(mtq.FP8_DEFAULT_CFG)
    assert fp8.algorithm == "max"
    assert fp8.experts.weight_amax == "vectorized"
    assert fp8.experts.input_amax == "shared"
    assert fp8.backward == BackwardConfig()


def test_preset_files_load_by_bare_name_and_equal_the_exported_dicts():
    assert load_config("fp8_default.yaml").model_dump() == mtq.FP8_DEFAULT_CFG
    assert load_config("int8_default.yaml").model_dump() == mtq.INT8_DEFAULT_CFG
    per_expert = load_config("fp8_per_expert.yaml")
    assert per_expert.experts.weight_amax == "per_expert"
    assert per_expert.experts.input_amax == "per_expert"
    assert per_expert.quant_cfg == load_config("fp8_default.yaml").quant_cfg


def test_presets_are_independent_dicts():
    a = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    a["quant_cfg"][0]["cfg"]["num_bits"] = 8
    assert to_config(a).resolve("x.weight_quantizer", "Linear").format == "int8"
    assert to_config(mtq.FP8_DEFAULT_CFG).resolve("x.weight_quantizer", "Linear").format == "e4m3"


# --------------------------------------------------------------------------------------------------------------
# Rules


def test_later_quant_cfg_entries_win():
    cfg = to_config({"quant_cfg": [
        {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": (4, 3)}},
        {"quantizer_name": "*fc2.weight_quantizer", "cfg": {"num_bits": 8, "axis": 0}},
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer", "enable": True},
    ]})
    fc1 = cfg.resolve("layers.0.fc1.weight_quantizer", "Linear")
    fc2 = cfg.resolve("layers.0.fc2.weight_quantizer", "Linear")
    assert (fc1.format, fc1.axis, fc1.enable) == ("e4m3", None, True)
    assert (fc2.format, fc2.axis, fc2.enable) == ("int8", 0, True)
    assert not cfg.resolve("layers.0.fc1.input_quantizer", "Linear").enable
    # An enable-only rule before a cfg rule is overridden by the cfg rule's own `enable`.
    cfg2 = to_config({"quant_cfg": [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": "e5m2"}},
    ]})
    i = cfg2.resolve("a.input_quantizer", "Linear")
    assert i.enable
    assert i.format == "e5m2"


def test_enable_false_entry_keeps_the_format_and_disables():
    cfg = to_config({"quant_cfg": [
        {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 4, "block_sizes": {-1: 128, "type": "dynamic"}}},
        {"quantizer_name": "*expert*", "enable": False},
    ]})
    r = cfg.resolve("mlp.experts.linear_fc1.weight_quantizer", "GroupedLinear")
    assert not r.enable
    assert r.format == "int4"
    assert r.block_size == 128
    assert cfg.resolve("mlp.linear_fc1.weight_quantizer", "Linear").enable


def test_unmatched_quantizer_resolves_to_none():
    cfg = to_config({"quant_cfg": [{"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8}}]})
    assert cfg.resolve("fc.input_quantizer", "Linear") is None


def test_parent_class_filters_by_the_owning_module_class():
    cfg = to_config({"quant_cfg": [
        {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": (4, 3)}},
        {"quantizer_name": "*weight_quantizer", "parent_class": "*Grouped*", "cfg": {"num_bits": (2, 1),
                                                                                   "block_sizes": {-1: 16}}},
        {"quantizer_name": "*", "parent_class": "RowParallelLinear", "enable": False},
    ]})
    assert cfg.resolve("experts.weight_quantizer", "TEGroupedLinear").format == "nvfp4"
    assert cfg.resolve("fc1.weight_quantizer", "ColumnParallelLinear").format == "e4m3"
    row = cfg.resolve("fc2.weight_quantizer", "RowParallelLinear")
    assert not row.enable
    assert row.format == "e4m3"
    assert cfg.resolve("fc2.weight_quantizer", "RowParallelLinearX").enable  # exact class name, not a prefix


def test_quantizer_name_wildcards_are_case_sensitive():
    cfg = to_config({"quant_cfg": [{"quantizer_name": "*Router*", "enable": False},
                                   {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8}}]})
    assert cfg.resolve("router.weight_quantizer", "Linear").enable


def test_entry_that_sets_neither_cfg_nor_enable_is_rejected():
    with pytest.raises(ConfigError, match="sets neither 'cfg' nor 'enable'"):
        to_config({"quant_cfg": [{"quantizer_name": "*weight_quantizer"}]})


@pytest.mark.parametrize(("attrs", "match"), [
    ({"num_bits": (4, 3), "block_sizes": {-1: 16, -3: 16}}, "last two dims"),
    ({"num_bits": (4, 3), "block_sizes": {-1: 128, -2: 128, "type": "static"}}, "always come from the current"),
    ({"num_bits": 8, "block_sizes": {-1: 128, -2: 128}}, "last dim only"),
    ({"num_bits": (2, 1)}, "needs block_sizes"),
    ({"num_bits": (2, 1), "block_sizes": {-1: 32}}, "needs block_sizes"),
    ({"num_bits": (2, 1), "block_sizes": {-1: 16, "scale_bits": (5, 2)}}, "scale_bits"),
    ({"num_bits": (2, 1), "block_sizes": {-1: 16}, "axis": 0}, "axis"),
    ({"num_bits": 4, "block_sizes": {-1: 128}, "axis": 0}, "axis=0 cannot be combined"),
    ({"num_bits": 4, "block_sizes": {-1: 0}}, "positive int"),
    ({"num_bits": 4, "block_sizes": {-2: 128}}, "last dim only"),
    ({"num_bits": 4, "block_sizes": {-1: 128, "type": "sometimes"}}, "expected 'static' or 'dynamic'"),
    ({"num_bits": 4, "block_sizes": {-1: 128, "foo": 1}}, "unsupported keys"),
    ({"num_bits": (3, 3)}, "unsupported num_bits"),
    ({"num_bits": True}, "unsupported num_bits"),
    ({"num_bits": 8, "fake": 1}, "Extra inputs"),
])
def test_quantizer_attribute_config_rejects_unsupported_combinations(attrs, match):
    with pytest.raises(ValueError, match=match):
        QuantizerAttributeConfig(**attrs)


def test_backward_config_validates_on_assignment():
    cfg = load_config("fp8_default.yaml")
    cfg.backward.mode = "quantized"
    cfg.backward.ste = "clipped"
    cfg.backward.grad_num_bits = (4, 3)
    assert cfg.backward.grad_format == "e4m3"
    with pytest.raises(ValueError, match="mode"):
        cfg.backward.mode = "fp8"
    with pytest.raises(ValueError, match="gradients can be fake-quantized to e4m3 or e5m2 only"):
        cfg.backward.grad_num_bits = 8


# --------------------------------------------------------------------------------------------------------------
# YAML and $import


def test_top_level_import_merges_the_other_file_first(tmp_path):
    tmp_path = tmp_path.resolve()
    _write(tmp_path / "base.yaml", """\
        quant_cfg:
          - quantizer_name: "*weight_quantizer"
            cfg: {num_bits: e4m3}
          - quantizer_name: "*input_quantizer"
            cfg: {num_bits: e4m3}
        experts: {weight_amax: shared, input_amax: per_expert}
        backward: {mode: high_precision}
        """)
    top = _write(tmp_path / "top.yaml", """\
        $import: base.yaml
        quant_cfg:
          - quantizer_name: "*input_quantizer"
            cfg: {num_bits: 8}
        experts: {weight_amax: per_expert}
        """)
    cfg = load_config(top)
    assert [e.quantizer_name for e in cfg.quant_cfg] == ["*weight_quantizer", "*input_quantizer", "*input_quantizer"]
    assert cfg.resolve("a.input_quantizer", "Linear").format == "int8"  # this file's entry comes later: it wins
    assert cfg.resolve("a.weight_quantizer", "Linear").format == "e4m3"
    # deep merge
    assert cfg.experts.weight_amax == "per_expert"
    assert cfg.experts.input_amax == "per_expert"
    assert cfg.backward.mode == "high_precision"


def test_import_as_a_quant_cfg_item_splices_entries_in_place(tmp_path):
    tmp_path = tmp_path.resolve()
    _write(tmp_path / "tail.yaml", """\
        quant_cfg:
          - quantizer_name: "*router*"
            enable: false
          - quantizer_name: "*special.weight_quantizer"
            cfg: {num_bits: 4, block_sizes: {-1: 128, type: dynamic}}
        backward: {mode: quantized}
        """)
    top = _write(tmp_path / "top.yaml", """\
        quant_cfg:
          - quantizer_name: "*weight_quantizer"
            cfg: {num_bits: 8, axis: 0}
          - $import: tail.yaml
          - quantizer_name: "*weight_quantizer"
            parent_class: Embedding
            enable: false
        """)
    cfg = load_config(top)
    assert [e.quantizer_name for e in cfg.quant_cfg] == [
        "*weight_quantizer", "*router*", "*special.weight_quantizer", "*weight_quantizer"]
    assert cfg.resolve("x.special.weight_quantizer", "Linear").block_size == 128
    assert not cfg.resolve("mlp.router.weight_quantizer", "Linear").enable
    assert cfg.backward.mode == "dequantized"  # only the entries are spliced, not the other keys


def test_nested_imports_and_a_list_of_imports(tmp_path):
    tmp_path = tmp_path.resolve()
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "sub" / "a.yaml", """\
        quant_cfg: [{quantizer_name: "*a", enable: false}]
        """)
    _write(tmp_path / "sub" / "b.yaml", """\
        $import: a.yaml
        quant_cfg: [{quantizer_name: "*b", enable: false}]
        """)
    _write(tmp_path / "c.yaml", """\
        quant_cfg: [{quantizer_name: "*c", enable: false}]
        """)
    top = _write(tmp_path / "top.yaml", """\
        $import: [sub/b.yaml, c.yaml]
        quant_cfg: [{quantizer_name: "*top", enable: false}]
        """)
    assert [e.quantizer_name for e in load_config(str(top)).quant_cfg] == ["*a", "*b", "*c", "*top"]


def test_importing_a_shipped_preset_by_relative_path(tmp_path):
    tmp_path = tmp_path.resolve()
    preset = mtq.preset_path("fp8_default.yaml")
    top = _write(tmp_path / "mine.yaml", f"""\
        $import: {preset}
        backward: {{mode: high_precision, ste: clipped}}
        """)
    cfg = load_config(top)
    assert cfg.quant_cfg == load_config(preset).quant_cfg
    assert (cfg.backward.mode, cfg.backward.ste) == ("high_precision", "clipped")


# --------------------------------------------------------------------------------------------------------------
# Errors name the file, the key and the value


def _config_error(path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


def test_unknown_top_level_key_suggests_the_right_one(tmp_path):
    p = _write(tmp_path.resolve() / "typo.yaml", """\
        quant_cfgg:
          - quantizer_name: "*weight_quantizer"
            cfg: {num_bits: 8}
        """)
    msg = _config_error(p)
    assert str(p) in msg
    assert "'quant_cfgg'" in msg
    assert "did you mean 'quant_cfg'?" in msg


def test_unknown_key_inside_cfg_names_its_path_and_suggests(tmp_path):
    p = _write(tmp_path.resolve() / "typo.yaml", """\
        quant_cfg:
          - quantizer_name: "*weight_quantizer"
            cfg: {num_bit: 8}
        """)
    msg = _config_error(p)
    assert str(p) in msg
    assert "quant_cfg.0.cfg" in msg
    assert "'num_bit'" in msg
    assert "'num_bits'" in msg


@pytest.mark.parametrize(("text", "key", "lines"), [
    ("experts: {weight_amax: per_expert}\nbackward: {mode: quantized}\nexperts: {weight_amax: shared}\n",
     "experts", (1, 3)),
    ("quant_cfg:\n  - quantizer_name: '*weight_quantizer'\n    cfg:\n      num_bits: 8\n      axis: 0\n"
     "      num_bits: e4m3\n", "quant_cfg.0.cfg.num_bits", (4, 6)),
    ("backward:\n  mode: quantized\n  ste: clipped\n  mode: dequantized\n", "backward.mode", (2, 4)),
    ("quant_cfg:\n  - {quantizer_name: '*', enable: false, enable: true}\n", "quant_cfg.0.enable", (2, 2)),
])
def test_a_key_given_twice_names_the_file_the_key_and_both_lines(tmp_path, text, key, lines):
    p = tmp_path.resolve() / "twice.yaml"
    p.write_text(text)
    msg = _config_error(p)
    assert msg.startswith(f"{p}: key '{key}' appears twice, on lines {lines[0]} and {lines[1]}"), msg


def test_a_key_of_an_imported_file_may_be_overridden_and_twice_in_an_imported_file_is_refused(tmp_path):
    tmp_path = tmp_path.resolve()
    _write(tmp_path / "base.yaml", "experts: {weight_amax: shared}\nbackward: {mode: high_precision}\n")
    top = _write(tmp_path / "top.yaml", "$import: base.yaml\nexperts: {weight_amax: per_expert}\n")
    assert load_config(top).experts.weight_amax == "per_expert"
    _write(tmp_path / "base.yaml", "backward: {mode: high_precision}\nbackward: {mode: quantized}\n")
    assert _config_error(top).startswith(f"{tmp_path / 'base.yaml'}: key 'backward' appears twice, on lines 1 and 2")


def test_unknown_key_in_backward_names_its_path(tmp_path):
    p = _write(tmp_path.resolve() / "typo.yaml", "backward: {mode: quantized, stee: clipped}\n")
    msg = _config_error(p)
    assert str(p) in msg
    assert "backward" in msg
    assert "'stee'" in msg
    assert "'ste'" in msg


def test_bad_num_bits_names_file_key_and_value(tmp_path):
    p = _write(tmp_path.resolve() / "bits.yaml", """\
        quant_cfg:
          - quantizer_name: "*weight_quantizer"
            cfg: {num_bits: [3, 3]}
        """)
    msg = _config_error(p)
    assert str(p) in msg
    assert "quant_cfg.0.cfg.num_bits" in msg
    assert "(3, 3)" in msg
    assert "(4, 3)" in msg


def test_unhashable_num_bits_is_a_config_error(tmp_path):
    p = _write(tmp_path.resolve() / "bits.yaml", """\
        quant_cfg:
          - quantizer_name: "*weight_quantizer"
            cfg: {num_bits: {a: 1}}
        """)
    msg = _config_error(p)
    assert str(p) in msg
    assert "num_bits" in msg


def test_missing_file_is_named(tmp_path):
    p = tmp_path.resolve() / "nope.yaml"
    assert str(p) in _config_error(p)


def test_import_of_a_missing_file_names_both_files(tmp_path):
    tmp_path = tmp_path.resolve()
    top = _write(tmp_path / "top.yaml", "$import: missing_base.yaml\n")
    msg = _config_error(top)
    assert str(tmp_path / "missing_base.yaml") in msg
    assert str(top) in msg


def test_quant_cfg_item_import_of_a_missing_file_names_both_files(tmp_path):
    tmp_path = tmp_path.resolve()
    top = _write(tmp_path / "top.yaml", "quant_cfg:\n  - $import: gone.yaml\n")
    msg = _config_error(top)
    assert str(tmp_path / "gone.yaml") in msg
    assert str(top) in msg


def test_import_cycle_is_reported_with_the_chain(tmp_path):
    tmp_path = tmp_path.resolve()
    a = _write(tmp_path / "a.yaml", "$import: b.yaml\n")
    b = _write(tmp_path / "b.yaml", "quant_cfg:\n  - $import: a.yaml\n")
    msg = _config_error(a)
    assert "import cycle" in msg
    assert "'$import'" in msg
    assert f"{a} -> {b} -> {a}" in msg


def test_self_import_is_a_cycle(tmp_path):
    a = _write(tmp_path.resolve() / "self.yaml", "$import: self.yaml\n")
    msg = _config_error(a)
    assert "import cycle" in msg
    assert str(a) in msg


def test_non_string_import_in_a_list_names_file_key_and_value(tmp_path):
    p = _write(tmp_path.resolve() / "bad.yaml", "$import: [5]\n")
    msg = _config_error(p)
    assert str(p) in msg
    assert "'$import'" in msg
    assert "5" in msg


def test_non_string_import_as_a_quant_cfg_item_names_file_key_and_value(tmp_path):
    p = _write(tmp_path.resolve() / "bad.yaml", "quant_cfg:\n  - $import: 5\n")
    msg = _config_error(p)
    assert str(p) in msg
    assert "quant_cfg.0.$import" in msg
    assert "5" in msg


@pytest.mark.parametrize("value", ["5", "null"])
def test_non_string_scalar_import_names_file_key_and_value(tmp_path, value):
    p = _write(tmp_path.resolve() / "bad.yaml", f"$import: {value}\n")
    msg = _config_error(p)
    assert str(p) in msg
    assert "'$import'" in msg
    assert value in msg


def test_bad_experts_weight_amax_names_file_key_and_value(tmp_path):
    p = _write(tmp_path.resolve() / "experts.yaml", "experts: {weight_amax: per_expertt}\n")
    msg = _config_error(p)
    assert str(p) in msg
    assert "experts.weight_amax" in msg
    assert "per_expertt" in msg
    assert "'per_expert'" in msg


def test_bad_backward_mode_names_file_key_and_value(tmp_path):
    p = _write(tmp_path.resolve() / "bw.yaml", "backward: {mode: fp8_training}\n")
    msg = _config_error(p)
    assert str(p) in msg
    assert "backward.mode" in msg
    assert "fp8_training" in msg
    assert "'high_precision'" in msg


def test_bad_ste_names_file_key_and_value(tmp_path):
    p = _write(tmp_path.resolve() / "bw.yaml", "backward: {ste: clip}\n")
    msg = _config_error(p)
    assert str(p) in msg
    assert "backward.ste" in msg
    assert "'clip'" in msg


def test_grad_num_bits_e2m1_is_rejected(tmp_path):
    p = _write(tmp_path.resolve() / "bw.yaml", "backward: {mode: quantized, grad_num_bits: e2m1}\n")
    msg = _config_error(p)
    assert str(p) in msg
    assert "backward.grad_num_bits" in msg
    assert "e2m1" in msg
    assert "e4m3 or e5m2" in msg


def test_nvfp4_without_block_sizes_is_rejected(tmp_path):
    p = _write(tmp_path.resolve() / "fp4.yaml", """\
        quant_cfg:
          - quantizer_name: "*weight_quantizer"
            cfg: {num_bits: e2m1}
        """)
    msg = _config_error(p)
    assert str(p) in msg
    assert "quant_cfg.0.cfg" in msg
    assert "e2m1" in msg
    assert "block_sizes" in msg


def test_non_mapping_top_level_and_non_list_quant_cfg(tmp_path):
    tmp_path = tmp_path.resolve()
    p = _write(tmp_path / "list.yaml", "- 1\n- 2\n")
    assert str(p) in _config_error(p)
    q = _write(tmp_path / "q.yaml", "quant_cfg: {quantizer_name: '*'}\n")
    msg = _config_error(q)
    assert str(q) in msg
    assert "'quant_cfg'" in msg


def test_invalid_yaml_names_the_file(tmp_path):
    p = _write(tmp_path.resolve() / "broken.yaml", "quant_cfg: [\n")
    msg = _config_error(p)
    assert str(p) in msg
    assert "YAML" in msg


def test_dict_config_errors_name_the_source_key_and_value():
    with pytest.raises(ConfigError) as info:
        to_config({"algorithm": "entropy"})
    msg = str(info.value)
    assert "<dict config>" in msg
    assert "algorithm" in msg
    assert "entropy" in msg
    with pytest.raises(ConfigError, match="expected a mapping"):
        to_config(["not", "a", "dict"])


def test_nvfp4_experts_fp8_preset_gives_routed_experts_nvfp4_and_every_other_linear_fp8():
    cfg = to_config(mtq.NVFP4_EXPERTS_FP8_CFG)
    assert cfg == load_config("nvfp4_experts_fp8.yaml")
    for q in ("weight_quantizer", "input_quantizer"):
        for routed in ("decoder.layers.0.mlp.experts.linear_fc1",
                       "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2"):
            assert cfg.resolve(f"{routed}.{q}", "Linear").format == "nvfp4"
        for other in ("decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.self_attention.linear_proj",
                      "decoder.layers.0.mlp.shared_experts.linear_fc1", "decoder.layers.0.mlp.linear_fc2"):
            r = cfg.resolve(f"{other}.{q}", "Linear")
            assert r.enable
            assert r.format == "e4m3"
            assert r.axis is None
        assert not cfg.resolve(f"decoder.layers.0.mlp.router.{q}", "TopKRouter").enable
        assert not cfg.resolve(f"output_layer.{q}", "ColumnParallelLinear").enable
    assert cfg.experts.weight_amax == cfg.experts.input_amax == "per_expert"
