"""gpt-oss's published MXFP4 experts (``*_blocks`` / ``*_scales``, ``quant_method: mxfp4``), read and written, as a
user's script does it; transformers 5.23 (``Mxfp4Config(dequantize=True)`` on CPU) is the reader of both sides.

Two checkpoints of the shipped ``configs/gpt_oss_tiny.json``: a bf16 one written by transformers, and an MXFP4 one in
the published layout (its experts random E2M1 codes and E8M0 scales, every other tensor the bf16 one's; the layout is
checked against transformers' own decoder in ``tests/unit/export/test_fused_mxfp4.py``). One spawn of 4 gloo ranks:

* import: the MXFP4 checkpoint imports at TP1 x EP1 and TP2 x EP2 (expert-TP 1) and the fp32 Megatron model's logits
  equal transformers' on the same files within 2e-5 of the largest logit; MXFP4 QAT of the imported experts starts
  from the same values (the export before any step decodes to the source's values, and stores the source's bytes
  wherever a block's largest code is 4 or 6);
* export: the bf16 model at TP2 x EP2 with MXFP4 weight-only experts, its expert weights moved by a training step's
  fp32 update, exports with ``format="hf-mxfp4"``; every expert's codes decode (with transformers' decoder) to
  training's fake quant of the Megatron weight bit for bit, transformers loads it and its logits equal our weight-only
  forward's within 2e-5 of the largest logit; non-expert layers stay bf16; unquantized experts, MXFP4 inputs on the
  experts, an FP8 attention and a family without fused experts are refused, naming the module, before anything is
  written; broken MXFP4 checkpoints (a ``_scales`` missing, a NaN scale) are refused with the model left as it was.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from limits import seconds  # noqa: E402
from megatron_harness.hf_families import hf_logits, rank_inputs, tensors, tiny_config

from modelopt_moe.launch import spawn
from modelopt_moe.quantization.config import preset_path

WORLD = 4
LAYOUTS = ((1, 1), (2, 2))  # (TP, EP)
VOCAB = 256
EXPERTS = ("gate_up_proj", "down_proj")
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def _save_bf16(path: Path) -> None:
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**tiny_config("gpt_oss_tiny.json")))
    with torch.no_grad():
        for name, t in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "sinks")):
                t.add_(torch.randn_like(t) * 0.1)
            if name.endswith("gate_up_proj"):  # pre-activations beyond swiglu_limit: the clamp bites
                t.copy_(torch.randn_like(t) * 0.5)
    model.to(torch.bfloat16)
    model.save_pretrained(path)


def _save_mxfp4(bf16: Path, path: Path) -> None:
    """The published layout: each fused expert weight ``[E, in, out]`` as ``_blocks`` ``[E, out, in/32, 16]`` (random
    codes) and ``_scales`` ``[E, out, in/32]`` (E8M0 2**-6 .. 2**-3), the config's ``quantization_config`` as
    openai/gpt-oss-20b's."""
    from safetensors.torch import save_file

    shutil.copytree(bf16, path)
    t = tensors(bf16)
    g = torch.Generator().manual_seed(2)
    for name in [n for n in t if n.endswith(EXPERTS)]:
        e, k, n = t.pop(name).shape
        t[name + "_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, generator=g)
        t[name + "_scales"] = torch.randint(121, 125, (e, n, k // 32), dtype=torch.uint8, generator=g)
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def _save_broken(mx_src: Path, path: Path) -> None:
    """Two broken copies: one ``_scales`` tensor missing, and one E8M0 scale of 255 (NaN) in the last layer."""
    from safetensors.torch import save_file

    for kind in ("no_scales", "nan_scale"):
        shutil.copytree(mx_src, path / kind)
        t = tensors(mx_src)
        if kind == "no_scales":
            del t["model.layers.1.mlp.experts.down_proj_scales"]
        else:
            t["model.layers.2.mlp.experts.gate_up_proj_scales"][5, 3, 1] = 255
        save_file(t, path / kind / "model.safetensors", metadata={"format": "pt"})


MXFP4_WEIGHTS = {"quant_cfg": [{"quantizer_name": "*experts*weight_quantizer",
                                "cfg": {"num_bits": (2, 1), "block_sizes": {-1: 32, "type": "dynamic",
                                                                            "scale_bits": (8, 0)}}}],
                 "algorithm": "max"}


def _train_experts(model, ep_rank: int) -> dict:
    """A training step's fp32 update of every expert weight (the same on the ranks that hold the same experts); returns
    this rank's experts' ``(fc1, fc2)`` weights by ``(layer, global expert)``."""
    g = torch.Generator().manual_seed(10 + ep_rank)
    experts = {}
    with torch.no_grad():
        for L, layer in enumerate(model.decoder.layers):
            local = layer.mlp.experts.local_experts
            for i, e in enumerate(local):
                for fc in (e.linear_fc1, e.linear_fc2):
                    fc.weight.add_(torch.randn(fc.weight.shape, generator=g) * 1e-3)
                experts[(L, ep_rank * len(local) + i)] = (e.linear_fc1.weight.clone(), e.linear_fc2.weight.clone())
    return experts


def _rank(rank, world_size, src, mx_src, qwen3_mx, broken, out):
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state, tensor_parallel

    import modelopt_moe.quantization as mtq
    from modelopt_moe.export import ExportError, build_megatron_model, export_hf, import_hf
    from modelopt_moe.plugins.megatron_cpu import apply_cpu_shims
    from modelopt_moe.quantization.config import preset_path

    apply_cpu_shims()  # the sliding-window mask runs on the CPU without enable_cpu_megatron's torch mode
    tokens, _, _, logits = rank_inputs(VOCAB)
    out, broken = Path(out), Path(broken)
    res = {"tokens": tokens, "errors": {}}

    def build(path, tp, ep):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                                 expert_tensor_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
        if path is None:  # a tiny Qwen3-MoE, random weights
            return build_megatron_model(preset_path("qwen3_moe_tiny.json"), params_dtype=torch.float32).eval()
        model = build_megatron_model(path, params_dtype=torch.float32)
        import_hf(model, path)
        return model.eval()

    def refused(key, model, **kw):
        try:
            export_hf(model, out / key, format="hf-mxfp4", progress=False, **kw)
        except ExportError as e:
            res["errors"][key] = str(e)

    for tp, ep in LAYOUTS:  # the published MXFP4 checkpoint in
        model = build(mx_src, tp, ep)
        if (tp, ep) == (1, 1):  # a broken one is refused before any parameter changes
            before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
            for key, path in (("no_scales", broken / "no_scales"), ("nan_scale", broken / "nan_scale")):
                try:
                    import_hf(model, path)
                except ExportError as e:
                    res["errors"][key] = str(e)
            after = model.state_dict()
            res["unchanged"] = all(torch.equal(after[k], v) for k, v in before.items())
        res[f"mx_import_tp{tp}_ep{ep}"] = logits(model)
        if (tp, ep) == (2, 2):  # MXFP4 QAT starts here: before any step, the export is the source
            mtq.quantize(model, MXFP4_WEIGHTS, lambda m: logits(m))
            export_hf(model, out / "requant", format="hf-mxfp4", dtype=torch.bfloat16, progress=False)
        parallel_state.destroy_model_parallel()

    model = build(src, 2, 2)  # the bf16 checkpoint, MXFP4 QAT'd experts out
    refused("unquantized", model)
    mtq.quantize(model, mtq.load_config("mxfp4_experts_only.yaml"), lambda m: logits(m))
    refused("inputs", model)
    mtq.disable_quantizer(model, "*experts*input_quantizer")
    res["experts"] = _train_experts(model, parallel_state.get_expert_model_parallel_rank())
    refused("compressed_tensors", model)  # the old formats keep refusing quantized fused experts
    try:
        export_hf(model, out / "ct", format="compressed-tensors", progress=False)
    except ExportError as e:
        res["errors"]["compressed_tensors"] = str(e)
    export_hf(model, out / "mx", format="hf-mxfp4", dtype=torch.bfloat16, progress=False)
    res["logits_mx"] = logits(model)  # weight-only: the experts' input quantizers are off
    parallel_state.destroy_model_parallel()

    model = build(src, 2, 2)  # FP8 attention beside MXFP4 experts: not the published mix
    mtq.quantize(model, {"quant_cfg": [*MXFP4_WEIGHTS["quant_cfg"],
                                       {"quantizer_name": "*self_attention*weight_quantizer",
                                        "cfg": {"num_bits": (4, 3), "axis": None}}], "algorithm": "max"},
                 lambda m: logits(m))
    refused("fp8_attention", model)
    parallel_state.destroy_model_parallel()

    model = build(None, 2, 2)  # a family whose experts are stored one by one has no such layout
    mtq.quantize(model, MXFP4_WEIGHTS, lambda m: logits(m))
    refused("qwen3", model)
    try:
        import_hf(model, qwen3_mx)
    except ExportError as e:
        res["errors"]["qwen3_import"] = str(e)
    parallel_state.destroy_model_parallel()
    return res


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    _save_bf16(base / "src")
    _save_mxfp4(base / "src", base / "mx_src")
    (base / "qwen3_mx").mkdir()  # a Qwen3-MoE config that claims MXFP4 experts
    cfg = json.loads(preset_path("qwen3_moe_tiny.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (base / "qwen3_mx" / "config.json").write_text(json.dumps(cfg))
    _save_broken(base / "mx_src", base / "broken")
    results = spawn(_rank, WORLD, args=(str(base / "src"), str(base / "mx_src"), str(base / "qwen3_mx"),
                                        str(base / "broken"), str(base / "out")), timeout=seconds(900))
    results[0]["experts"] = {k: v for r in results for k, v in r["experts"].items()}
    return base, results[0]


def _mxfp4_config():
    from transformers.utils.quantization_config import Mxfp4Config

    return Mxfp4Config(dequantize=True)


def _decoded(t: dict, name: str) -> torch.Tensor:
    """The fp32 ``[E, in, out]`` weight transformers' own decoder reads from a fused expert's tensors."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(t[name + "_blocks"], t[name + "_scales"], dtype=torch.float32)


@pytest.mark.parametrize(("tp", "ep"), LAYOUTS)
def test_published_mxfp4_checkpoint_imports_with_transformers_logits(run, tp, ep):
    base, r = run
    ref = hf_logits(base / "mx_src", r["tokens"], quantization_config=_mxfp4_config())
    diff = (r[f"mx_import_tp{tp}_ep{ep}"] - ref).abs().max().item()
    print(f"MXFP4 import TP{tp} x EP{ep}: logits max |Megatron - transformers| = {diff:.3g} "
          f"(largest {ref.abs().max():.3g})")
    assert diff <= 2e-5 * ref.abs().max().item()


def test_mxfp4_qat_of_an_imported_checkpoint_starts_from_its_codes(run):
    base, _ = run
    source, again = tensors(base / "mx_src"), tensors(base / "out" / "requant")
    assert sorted(again) == sorted(source)
    same_bytes = 0
    for name in [n.removesuffix("_blocks") for n in source if n.endswith("_blocks")]:
        assert torch.equal(_decoded(again, name), _decoded(source, name)), name
        blocks, scales = source[name + "_blocks"], source[name + "_scales"]
        top = torch.maximum(blocks & 7, (blocks >> 4) & 7).amax(-1) >= 6  # the block's largest code is 4 or 6
        assert torch.equal(again[name + "_scales"][top], scales[top]), name
        assert torch.equal(again[name + "_blocks"][top], blocks[top]), name
        same_bytes += int(top.sum())
    assert same_bytes > 0.99 * sum(t.numel() for n, t in source.items() if n.endswith("_scales"))


def test_mxfp4_export_decodes_to_training_fake_quant_bit_for_bit(run):
    from modelopt_moe.numerics import fake_quant

    base, r = run
    source, t = tensors(base / "src"), tensors(base / "out" / "mx")
    for L in range(3):
        for k, proj in enumerate(EXPERTS):
            name = f"model.layers.{L}.mlp.experts.{proj}"
            assert name not in t
            assert t[name + "_blocks"].dtype == t[name + "_scales"].dtype == torch.uint8
            trained = []
            for e in range(8):  # training's fake quant of the Megatron weight, in the file's [in, out] layout
                q = fake_quant(r["experts"][(L, e)][k], "mxfp4", None, 32)
                if proj == "gate_up_proj":  # Megatron's [gate; up] rows -> gate and up interleaved
                    q = torch.stack(q.chunk(2), 1).flatten(0, 1)
                trained.append(q.t())
            assert torch.equal(_decoded(t, name), torch.stack(trained)), name
            assert t[name + "_bias"].dtype == torch.bfloat16
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.router.weight", "lm_head.weight",
                 "model.embed_tokens.weight", "model.layers.0.self_attn.sinks"):
        assert t[name].dtype == torch.bfloat16, name
        assert torch.equal(t[name], source[name]), name
    cfg = json.loads((base / "out" / "mx" / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "mxfp4"
    assert set(qc["modules_to_not_convert"]) >= {"model.layers.*.self_attn.q_proj", "model.layers.*.mlp.router",
                                                 "model.embed_tokens", "lm_head"}
    card = (base / "out" / "mx" / "README.md").read_text()
    assert ("| `model.layers.*.mlp.experts.gate_up_proj` | 0-2 | 3 | MXFP4: E2M1, E8M0 scale per block of 32 inputs "
            "| bfloat16, not quantized |") in card


def test_mxfp4_export_loads_in_transformers_with_our_weight_only_logits(run):
    base, r = run
    ref = hf_logits(base / "out" / "mx", r["tokens"], quantization_config=_mxfp4_config())
    diff = (r["logits_mx"] - ref).abs().max().item()
    print(f"hf-mxfp4 export in transformers: logits max |Megatron weight-only - transformers| = {diff:.3g} "
          f"(largest {ref.abs().max():.3g})")
    assert diff <= 2e-5 * ref.abs().max().item()


def test_other_quantization_mixes_are_refused_naming_the_module(run):
    base, r = run
    errors = r["errors"]
    experts = "decoder.layers.0.mlp.experts.linear_fc1"
    assert f"{experts}: format='hf-mxfp4' stores MXFP4 experts" in errors["unquantized"]
    assert f"{experts}: format='hf-mxfp4' is weight-only" in errors["inputs"]
    assert "input mxfp4" in errors["inputs"]
    assert "model.layers.0.self_attn.q_proj is quantized" in errors["fp8_attention"]
    assert (f"{experts}: quantized experts stored fused as 3-D tensors (gpt_oss) export only as MXFP4 weights in the "
            "published layout (format='hf-mxfp4'") in errors["compressed_tensors"]
    assert ("MXFP4 fused experts come as _blocks and _scales pairs: model.layers.1.mlp.experts.down_proj_blocks "
            "without model.layers.1.mlp.experts.down_proj_scales") in errors["no_scales"]
    assert "model.layers.2.mlp.experts.gate_up_proj_scales: holds 255, E8M0's NaN" in errors["nan_scale"]
    assert r["unchanged"]  # all or nothing: the model is as before the refused imports
    assert ("format='hf-mxfp4' stores fused 3-D experts (gpt-oss's layout); Qwen3MoeForCausalLM stores its experts "
            "one by one") in errors["qwen3"]
    assert "quant_method='mxfp4'" in errors["qwen3_import"]
    assert "not Qwen3MoeForCausalLM" in errors["qwen3_import"]
    for key in ("unquantized", "inputs", "fp8_attention", "ct", "qwen3"):
        assert not (base / "out" / key).exists(), key  # refused before anything is written
