"""``gemm: te_fp8`` on the CPU: the config takes it (and the former ``kernel: te_fp8``); modules that are not
Transformer Engine grouped linears run fake quant exactly as with ``gemm: fake_quant`` (the documented fallback); the
checks that refuse what the FP8 GEMM cannot run
(``modelopt_moe.plugins.te_fp8.problems``, importable without Transformer Engine). The FP8 path itself:
``tests/gpu/test_te_fp8_gpu.py``."""

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from pydantic import ValidationError

import modelopt_moe.quantization as mtq
from modelopt_moe.plugins import te_fp8
from modelopt_moe.quantization.config import ConfigError, QuantizeConfig, load_config, to_config
from modelopt_moe.quantization.nn import GroupedLinear

N, IN, OUT = 4, 32, 16
SPLITS = [5, 0, 7, 8]


def test_te_fp8_is_a_gemm_in_dicts_yaml_files_and_assignments(tmp_path):
    assert to_config({"gemm": "te_fp8"}).gemm == "te_fp8"
    path = tmp_path / "fp8_te.yaml"
    path.write_text(textwrap.dedent("""\
        $import: fp8_experts.yaml
        gemm: te_fp8
        kernel: triton
    """))
    loaded = load_config(path)
    assert (loaded.gemm, loaded.kernel) == ("te_fp8", "triton")
    cfg = load_config("fp8_default.yaml")
    cfg.gemm = "te_fp8"
    assert QuantizeConfig(**cfg.model_dump()).gemm == "te_fp8"  # a saved quantization state restores it
    with pytest.raises(ConfigError, match="te_fp8"):  # the allowed values are listed
        to_config({"gemm": "fp8"}, source="cfg.yaml")
    with pytest.raises(ValidationError):
        cfg.gemm = "te_fp16"
    with pytest.raises(ValidationError):
        cfg.kernel = "te_fp16"


def test_the_former_kernel_te_fp8_still_reads_as_gemm_te_fp8(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("$import: fp8_default.yaml\nkernel: te_fp8\n")
    cfg = load_config(path)
    assert (cfg.gemm, cfg.kernel) == ("te_fp8", "auto")
    assert (to_config({"kernel": "te_fp8"}).gemm, to_config({"kernel": "te_fp8"}).kernel) == ("te_fp8", "auto")
    assigned = load_config("fp8_default.yaml")
    assigned.kernel = "te_fp8"
    assert (assigned.gemm, assigned.kernel) == ("te_fp8", "auto")
    edited_preset = to_config({**mtq.FP8_DEFAULT_CFG, "kernel": "te_fp8"})  # the dumped preset says gemm: fake_quant
    assert (edited_preset.gemm, edited_preset.kernel) == ("te_fp8", "auto")


def test_the_former_kernel_te_fp8_warns_once_per_process(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("$import: fp8_default.yaml\nkernel: te_fp8\n")
    code = ("import warnings\nimport modelopt_moe.quantization as mtq\nwarnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            f"    warnings.simplefilter('always')\n    mtq.load_config({str(path)!r}); mtq.load_config({str(path)!r})\n"
            "print([str(w.message) for w in caught if issubclass(w.category, FutureWarning)])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    messages = eval(done.stdout.strip())
    assert len(messages) == 1
    assert "gemm: te_fp8" in messages[0]


def _config(gemm, preset="fp8_default.yaml", **experts):
    cfg = mtq.load_config(preset)
    cfg.gemm = gemm
    cfg.experts.input_amax = "per_expert"
    for key, value in experts.items():
        setattr(cfg.experts, key, value)
    return cfg


def _quantized(cfg, calibrate=True):
    torch.manual_seed(0)
    layer = GroupedLinear(N, IN, OUT, bias=True)
    x = torch.randn(sum(SPLITS), IN, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, cfg, (lambda m: m(x, SPLITS)) if calibrate else None)
    return layer


def _run(layer):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(sum(SPLITS), IN, generator=g).requires_grad_(True)
    y = layer(x, SPLITS)
    y.backward(torch.randn(y.shape, generator=g))
    return y.detach(), x.grad, [w.grad for w in layer.expert_weights()]


@pytest.mark.parametrize("mode", ["dequantized", "high_precision"])
def test_a_model_without_te_grouped_linears_runs_fake_quant_as_with_gemm_fake_quant(mode):
    runs = {}
    for gemm in ("fake_quant", "te_fp8"):
        cfg = _config(gemm)
        cfg.backward.mode = mode
        layer = _quantized(cfg)
        assert layer.quant_gemm == gemm
        assert te_fp8.problems(layer) == []
        runs[gemm] = _run(layer)
    (y_a, dx_a, dw_a), (y_t, dx_t, dw_t) = runs["fake_quant"], runs["te_fp8"]
    assert torch.equal(y_a, y_t)
    assert torch.equal(dx_a, dx_t)
    assert all(torch.equal(a, b) for a, b in zip(dw_a, dw_t, strict=True))


def test_te_fp8_engages_after_calibration_only():
    layer = _quantized(_config("te_fp8"))
    assert te_fp8.engaged(layer)
    layer.input_quantizer.enable_calib()
    assert not te_fp8.engaged(layer)  # calibrating: the fake-quant path collects the amax
    layer.input_quantizer.disable_calib()
    layer.input_quantizer.disable()
    layer.weight_quantizer.disable()
    assert not te_fp8.engaged(layer)  # nothing quantized: the float layer
    assert not te_fp8.engaged(_quantized(_config("fake_quant")))


@pytest.mark.parametrize(("preset", "change", "message"), [
    ("nvfp4_default.yaml", None, "format nvfp4"),
    ("int8_default.yaml", None, "format int8"),
    ("mxfp8_default.yaml", None, "format mxfp8 scales each block of 32"),
    ("fp8_default.yaml", lambda m: m.input_quantizer.disable(), "input_quantizer is not quantizing"),
    ("fp8_default.yaml", lambda m: m.weight_quantizer.disable(), "weight_quantizer is not quantizing"),
    ("fp8_default.yaml", lambda m: m.output_quantizer.enable(), "output_quantizer is enabled"),
    ("fp8_default.yaml", lambda m: m.weight_quantizer.set_from_attribute_config({"axis": 0}), "per-channel"),
    ("fp8_default.yaml", lambda m: m.input_quantizer.set_from_attribute_config({"type": "dynamic"}), "dynamic"),
])
def test_problems_name_what_the_fp8_gemm_cannot_run(preset, change, message):
    layer = _quantized(_config("te_fp8", preset))
    if change is not None:
        change(layer)
    found = te_fp8.problems(layer)
    assert any(message in p for p in found), found
    with pytest.raises(ConfigError, match="gemm te_fp8 cannot run"):
        te_fp8.check(layer)


def test_an_uncalibrated_input_amax_is_refused():
    layer = _quantized(_config("te_fp8"), calibrate=False)
    assert any("no calibrated amax" in p for p in te_fp8.problems(layer))
