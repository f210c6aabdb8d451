"""The exported KV-cache scales against training's fake quant, in the engines' order, and the refusals of KV caches no
checkpoint expresses."""

import re

import pytest
import torch

from modelopt_moe.export import ExportError
from modelopt_moe.export.kv_cache import KvCacheQuant, kv_cache_plan, read_kv_cache_scales
from modelopt_moe.numerics import fake_quant
from modelopt_moe.numerics.fp8 import E4M3, fp8_scale


@pytest.mark.parametrize("file_format", ["compressed-tensors", "modelopt"])
def test_engine_order_from_the_exported_k_scale_stores_the_codes_training_rounded_to(file_format):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        k = torch.randn(4096, generator=g) * torch.rand(1, generator=g) * 10
        amax = k.abs().max() * torch.empty(1).uniform_(0.5, 1.2, generator=g)
        plan = kv_cache_plan([KvCacheQuant("e4m3", "e4m3", amax, amax * 2)], file_format)
        tensors = plan.tensors(0, "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj", file_format)
        k_scale = next(t for name, t in tensors.items() if name.endswith("k_scale")).reshape(())
        # vLLM writes fp8(k / k_scale) to its cache and reads codes * k_scale
        engine_codes = (k / k_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        ours = fake_quant(k, "e4m3", amax.reshape(()))
        train_codes = (k * fp8_scale(amax)).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(engine_codes.view(torch.uint8), train_codes.view(torch.uint8))
        torch.testing.assert_close(engine_codes.float() * k_scale, ours, rtol=2**-23, atol=0)


def test_kv_caches_no_checkpoint_expresses_are_refused_naming_the_layer():
    a = torch.tensor(3.0)
    cases = {
        "K=e4m3, V=None": [KvCacheQuant("e4m3", None, a, None)],
        "layer 1: KV cache quantized as K=None, V=None": [KvCacheQuant("e4m3", "e4m3", a, a), KvCacheQuant(None, None)],
        "v_bmm_quantizer amax 0.0": [KvCacheQuant("e4m3", "e4m3", a, torch.tensor(0.0))],
        "k_bmm_quantizer amax None": [KvCacheQuant("e4m3", "e4m3", None, a)],
        "KV cache in FP8 E5M2": [KvCacheQuant("e5m2", "e5m2", a, a)],
    }
    for needle, layers in cases.items():
        with pytest.raises(ExportError, match=re.escape(needle)):
            kv_cache_plan(layers, "modelopt")
    assert kv_cache_plan([KvCacheQuant(), KvCacheQuant()], "modelopt") is None


KV_MODULES = [(f"model.layers.{L}.self_attn.k_proj", f"model.layers.{L}.self_attn.v_proj") for L in range(2)]


@pytest.mark.parametrize("file_format", ["compressed-tensors", "modelopt"])
def test_the_engine_side_reads_back_every_layers_written_kv_scales(file_format):
    amax = [(torch.tensor(3.0), torch.tensor(0.5)), (torch.tensor(7.0), torch.tensor(1e-3))]
    plan = kv_cache_plan([KvCacheQuant("e4m3", "e4m3", k, v) for k, v in amax], file_format)
    tensors = {n: t for L, (k, v) in enumerate(KV_MODULES) for n, t in plan.tensors(L, k, v, file_format).items()}
    config = plan.config_entries(file_format)
    fmt, scales = read_kv_cache_scales(config, file_format, tensors, KV_MODULES)
    assert fmt is E4M3
    for (k_amax, v_amax), (k_scale, v_scale) in zip(amax, scales, strict=True):
        assert torch.equal(k_scale, 1 / fp8_scale(k_amax))
        assert torch.equal(v_scale, 1 / fp8_scale(v_amax))
    assert read_kv_cache_scales({"kv_cache_scheme": None, "kv_cache_quant_algo": None}, file_format, tensors,
                                KV_MODULES) is None


def test_kv_scales_the_engines_cannot_use_are_refused_naming_the_tensor():
    plan = kv_cache_plan([KvCacheQuant("e4m3", "e4m3", torch.tensor(3.0), torch.tensor(2.0))] * 2, "modelopt")
    good = {n: t for L, (k, v) in enumerate(KV_MODULES) for n, t in plan.tensors(L, k, v, "modelopt").items()}
    config = plan.config_entries("modelopt")
    v1 = "model.layers.1.self_attn.v_proj.v_scale"
    cases = {
        f"{v1}: absent": ({k: t for k, t in good.items() if k != v1}, config),
        f"{v1}: torch.float32 [] [0.0]": ({**good, v1: torch.tensor(0.0)}, config),
        f"{v1}: torch.float32 [] [nan]": ({**good, v1: torch.tensor(float("nan"))}, config),
        "kv_cache_quant_algo 'INT8': expected one of ['FP8', 'NVFP4']": (good, {"kv_cache_quant_algo": "INT8"}),
    }
    for needle, (tensors, cfg) in cases.items():
        with pytest.raises(ExportError, match=re.escape(needle)):
            read_kv_cache_scales(cfg, "modelopt", tensors, KV_MODULES)
    with pytest.raises(ExportError, match=re.escape("kv_cache_scheme {'num_bits': 4")):
        read_kv_cache_scales({"kv_cache_scheme": {"num_bits": 4, "type": "int"}}, "compressed-tensors", good,
                             KV_MODULES)
