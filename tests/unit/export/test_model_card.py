"""The model card every export writes (modelopt_moe/export/model_card.py), from a scheme description: the front
matter the Hugging Face Hub reads, the quantization per group of modules, the readers, and the transformers fix for
compressed-tensors NVFP4 experts (the exported card of a real model is checked in tests/distributed/test_hf_export.py).
"""

import ast

import pytest
import yaml

from modelopt_moe.export import ExportError
from modelopt_moe.export.model_card import model_card
from modelopt_moe.export.schemes import LinearQuant, QuantSpec

NVFP4 = LinearQuant(QuantSpec("nvfp4"), QuantSpec("nvfp4"))
FP8 = LinearQuant(QuantSpec("e4m3"), QuantSpec("e4m3"))
OFF = LinearQuant()
LAYERS, EXPERTS = 4, 3


def _linears(quant: LinearQuant, expert_layers=range(LAYERS)) -> dict[str, LinearQuant]:
    """A Qwen3-MoE's linears: attention and experts quantized (experts of ``expert_layers`` only), routers and
    ``lm_head`` not."""
    out = {}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        out.update({f"{p}self_attn.{m}": quant for m in ("q_proj", "k_proj", "v_proj", "o_proj")})
        out[p + "mlp.gate"] = OFF
        for e in range(EXPERTS):
            out.update({f"{p}mlp.experts.{e}.{m}": quant if layer in expert_layers else OFF
                        for m in ("gate_proj", "up_proj", "down_proj")})
    out["lm_head"] = OFF
    return out


OTHERS = ["model.embed_tokens", "model.norm", *(f"model.layers.{i}.{m}" for i in range(LAYERS)
                                                for m in ("input_layernorm", "post_attention_layernorm"))]


def _card(fmt, quant, **kw):
    return model_card(architecture="Qwen3MoeForCausalLM", fmt=fmt, linears=_linears(quant, **kw.pop("layers", {})),
                      other_modules=OTHERS, dtype="bfloat16", name="my-model-out", **kw)


def _front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def _row(card: str, pattern: str) -> str:
    rows = [line for line in card.splitlines() if line.startswith(f"| `{pattern}` |")]
    assert len(rows) == 1, (pattern, card)
    return rows[0]


def test_nvfp4_compressed_tensors_card_states_the_scheme_and_opens_with_the_transformers_fix():
    card = _card("compressed-tensors", NVFP4, base_model="Qwen/Qwen3-30B-A3B")
    meta = _front_matter(card)
    assert meta["library_name"] == "transformers"
    assert meta["base_model"] == "Qwen/Qwen3-30B-A3B"
    assert meta["base_model_relation"] == "quantized"
    assert {"quantized", "nvfp4", "compressed-tensors"} <= set(meta["tags"])
    assert "# my-model-out: Qwen3MoeForCausalLM, NVFP4 (compressed-tensors)" in card
    assert "`format: nvfp4-pack-quantized`" in card
    # the warning and the fix come before the scheme, with code that calls the fix before loading this checkpoint
    warning = card.index("transformers reads the MoE experts of this checkpoint wrong without a fix")
    assert warning < card.index("## Quantization per layer")
    code = card.split("```python\n")[1].split("```")[0]
    calls = [ast.unparse(n.func) for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call)]
    assert calls.index("transformers_compat.fix_nvfp4_experts") < calls.index("AutoModelForCausalLM.from_pretrained")
    assert 'from_pretrained("my-model-out"' in code
    assert "CompressedTensorsConfig(dequantize=True)" in code
    # per group of modules: which layers, how many, weights and inputs with block size and scale tensors
    experts = _row(card, "model.layers.*.mlp.experts.*.down_proj")
    assert f"| 0-3 | {LAYERS * EXPERTS} |" in experts
    assert "| NVFP4: E2M1, E4M3 scale per block of 16 inputs, fp32 global scale | NVFP4: E4M3 scale per block of 16 " \
           "computed at run time, static fp32 global scale |" in experts
    assert "NVFP4" in _row(card, "model.layers.*.self_attn.q_proj")
    assert "| bfloat16, not quantized | bfloat16, not quantized |" in _row(card, "model.layers.*.mlp.gate")
    assert "bfloat16, not quantized" in _row(card, "lm_head")
    assert "Not quantized, stored in bfloat16: `model.embed_tokens`, `model.norm`, `model.layers.*.input_layernorm`" \
           in card
    assert "`weight_packed` uint8 `[out, in/2]` (two E2M1 codes per byte" in card
    assert "`weight_global_scale` fp32 = 2688 / amax, `input_global_scale` fp32 = 2688 / input amax" in card
    assert "**wrong for the MoE experts without the fix above**" in card


def test_modelopt_fp8_card_names_its_readers_and_needs_no_fix():
    card = _card("modelopt", FP8)
    meta = _front_matter(card)
    assert "base_model" not in meta  # unknown: not made up
    assert {"quantized", "fp8", "modelopt"} <= set(meta["tags"])
    assert "`quant_algo: FP8`" in card
    assert "hf_quant_config.json" in card
    assert "fix_nvfp4_experts" not in card
    row = _row(card, "model.layers.*.mlp.experts.*.gate_proj")
    assert "| FP8 E4M3, fp32 scale per tensor | FP8 E4M3, static fp32 scale per tensor |" in row
    assert "`weight_scale` fp32 `[]` = amax / 448, `input_scale` fp32 = input amax / 448" in card
    assert "vLLM (`quant_method: modelopt`), SGLang and TensorRT-LLM" in card


def test_modelopt_nvfp4_card_points_to_the_fix_after_conversion():
    card = _card("modelopt", NVFP4)
    assert "NVFP4" in _row(card, "model.layers.*.mlp.experts.*.up_proj")
    assert "`weight_scale_2` fp32 = amax / 2688" in card
    assert "ModelOptNvfp4Converter" in card
    assert "fix_nvfp4_experts()" in card
    assert "```python" not in card  # the fix is for the compressed-tensors checkpoint the conversion writes


def test_layers_left_unquantized_get_their_own_rows():
    card = _card("compressed-tensors", FP8, layers={"expert_layers": (0, 2, 3)})
    rows = [line for line in card.splitlines() if line.startswith("| `model.layers.*.mlp.experts.*.up_proj` |")]
    assert len(rows) == 2, card
    assert f"| 0, 2-3 | {3 * EXPERTS} | FP8 E4M3" in rows[0]
    assert f"| 1 | {EXPERTS} | bfloat16, not quantized |" in rows[1]
    assert "fix_nvfp4_experts" not in card  # FP8 experts load right


def test_unquantized_card_and_an_inexpressible_scheme():
    card = _card("hf", OFF)
    assert "quantized" not in _front_matter(card)["tags"]
    assert "an unquantized Hugging Face checkpoint" in card
    with pytest.raises(ExportError, match="no Model Optimizer quant_algo"):
        _card("modelopt", LinearQuant(QuantSpec("e4m3", axis=0), None))
