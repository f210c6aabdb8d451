"""The engine-contract checker on every trained format beyond FP8 per tensor and NVFP4, and on the KV cache.

One single-rank spawn imports tiny random Qwen3-MoE models (written by transformers) into Megatron, quantizes them
(FP8_DYNAMIC, INT4 W4A16 groups of 32, MXFP4, MXFP8, FP8 128x128 blocks on a model whose head_dim and expert FFN
size are 128, and FP8 per expert with an FP8 KV cache) and exports them through the public API in the file formats
whose engines read them. Every export passes the engines that read it (FP8_PB_WO fails on TensorRT-LLM, which has
no such quant_algo; so do the compressed-tensors schemes its reader refuses: INT4, MXFP8, per-tensor FP8, and
per-channel FP8 without per-token inputs); defects planted into copies (a deleted scale, a zero scale, a denormal
scale, a NaN E8M0 scale, a wrong dtype, a wrong shape, a missing k_scale) are each found, naming the tensor. A W4A16
checkpoint written by compressed-tensors' own compressor passes. ``calibration_tokens.json`` holds what calibration
counted, and ``modelopt-moe check`` reports it per layer and flags the experts below the export's threshold.
"""

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from limits import seconds  # noqa: E402

from modelopt_moe.export import check_checkpoint
from modelopt_moe.launch import spawn

LAYERS, EXPERTS = 2, 4
ENGINES = ("vllm", "sglang", "trtllm")
CT, MO = "compressed-tensors", "modelopt"
_MX = "{num_bits: [%s], block_sizes: {-1: 32, type: dynamic, scale_bits: [8, 0]}}"
CONFIGS = {  # name -> YAML of its quantization config
    "fp8_dynamic": ('quant_cfg:\n  - quantizer_name: "*weight_quantizer"\n    cfg: {num_bits: e4m3, axis: 0}\n'
                    '  - quantizer_name: "*input_quantizer"\n    cfg: {num_bits: e4m3, type: dynamic, block_sizes: '
                    '{-1: null}}\n  - quantizer_name: "*experts*input_quantizer"\n    cfg: {num_bits: e4m3, type: '
                    'dynamic}\n  - $import: _default_tail.yaml\nalgorithm: max\n'),
    "w4a16": ('quant_cfg:\n  - quantizer_name: "*weight_quantizer"\n    cfg: {num_bits: 4, block_sizes: {-1: 32, type: '
              'dynamic}}\n  - quantizer_name: "*input_quantizer"\n    enable: false\n  - $import: _default_tail.yaml\n'
              'algorithm: max\n'),
    "mxfp4": "$import: mxfp4_default.yaml\n",
    "mxfp8": "$import: mxfp8_default.yaml\n",
    "fp8_block": "$import: fp8_block_w8a8.yaml\n",
    "fp8_kv": "$import: [fp8_per_expert.yaml, fp8_kv.yaml]\n",
}
EXPORTS = {  # name -> (config, model, format, engines that read it)
    "fp8_dynamic_ct": ("fp8_dynamic", "narrow", CT, ENGINES),
    "fp8_dynamic_modelopt": ("fp8_dynamic", "narrow", MO, ENGINES),
    "w4a16_ct": ("w4a16", "narrow", CT, ("vllm", "sglang")),
    "mxfp4_ct": ("mxfp4", "narrow", CT, ENGINES),
    "mxfp8_ct": ("mxfp8", "narrow", CT, ("vllm", "sglang")),
    "mxfp8_modelopt": ("mxfp8", "narrow", MO, ("vllm", "sglang")),
    "fp8_block_ct": ("fp8_block", "wide", CT, ENGINES),
    "fp8_block_modelopt": ("fp8_block", "wide", MO, ("vllm", "sglang")),
    "fp8_kv_ct": ("fp8_kv", "narrow", CT, ("vllm", "sglang")),
    "fp8_kv_modelopt": ("fp8_kv", "narrow", MO, ENGINES),
}
EXPERT = "model.layers.1.mlp.experts.2"
ATTN = "model.layers.1.self_attn"


def _make_hf(path: Path, wide: bool) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    dims = dict(hidden_size=256, num_attention_heads=2, head_dim=128, moe_intermediate_size=128) if wide else \
        dict(hidden_size=64, num_attention_heads=4, head_dim=16, moe_intermediate_size=32)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=128, num_hidden_layers=LAYERS, num_key_value_heads=2,
                                               num_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=64,
                                               **dims))
    model.to(torch.bfloat16).save_pretrained(path)


def _export(rank, world, paths: dict) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import tensor_parallel

    import modelopt_moe.quantization as mtq
    from modelopt_moe.export import build_megatron_model, export_hf, import_hf
    from modelopt_moe.plugins.megatron import init_model_parallel
    from modelopt_moe.quantization.calib.tokens import expert_token_counts

    init_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 128, (2, 16), generator=g) for _ in range(2)]

    def calibrate(m):
        for b in batches:
            seq = b.shape[1]
            mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
            with torch.no_grad():
                m(b, torch.arange(seq).expand_as(b), mask)

    models, tokens = {}, {}
    for name, (config, model, fmt, _) in EXPORTS.items():
        if config not in models:
            m = build_megatron_model(paths[model], perform_initialization=False, params_dtype=torch.float32)
            import_hf(m, paths[model])
            mtq.quantize(m.eval(), mtq.load_config(paths[config]), calibrate)
            models[config] = m
            tokens[config] = expert_token_counts(m)
        export_hf(models[config], Path(paths["out"]) / name, format=fmt, progress=False)
    return tokens


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    base = tmp_path_factory.mktemp("check_formats")
    paths = {"out": str(base / "out")}
    for model in ("narrow", "wide"):
        paths[model] = str(base / model)
        _make_hf(base / model, model == "wide")
    for name, text in CONFIGS.items():
        paths[name] = str(base / f"test_{name}.yaml")  # not a preset's name: its $import would find itself
        Path(paths[name]).write_text(text)
    (tokens,) = spawn(_export, 1, args=(paths,), timeout=seconds(600))
    return {"base": base, "out": base / "out", "hf": paths, "tokens": tokens}


def _planted(exports, name: str, edit, config_edit=None) -> Path:
    """A copy of export ``name`` with ``edit(tensors)`` applied to every shard's tensors (dropped keys leave the
    index too, added ones join it) and ``config_edit(config)`` to its config.json."""
    from safetensors.torch import load_file, save_file

    dst = Path(tempfile.mkdtemp(dir=exports["base"])) / name
    shutil.copytree(exports["out"] / name, dst)
    dropped, added = set(), {}
    for shard in sorted(dst.glob("*.safetensors")):
        tensors = load_file(shard)
        before = set(tensors)
        edit(tensors)
        dropped |= before - set(tensors)
        added.update({k: shard.name for k in set(tensors) - before})
        save_file(tensors, shard, metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"] = {k: v for k, v in data["weight_map"].items() if k not in dropped} | added
    index.write_text(json.dumps(data))
    if config_edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _rules(report) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in report.errors:
        out.setdefault(f.rule, set()).add(f.where)
    return out


@pytest.mark.parametrize("name", list(EXPORTS))
def test_our_exports_pass_the_engines_that_read_them(exports, name):
    readers = EXPORTS[name][3]
    linears = LAYERS * (4 + 3 * EXPERTS)
    for engine in readers:
        report = check_checkpoint(exports["out"] / name, engine=engine)
        print(report.details())
        assert report.ok, report.details()
        assert not report.warnings, report.details()
        assert sum(report.schemes.values()) == linears, report.schemes
        assert "no rules" not in report.details()
    if name.startswith("fp8_kv"):
        assert report.kv_cache == "FP8"


@pytest.mark.parametrize(("name", "refusal"), [("w4a16_ct", "integer weights"), ("mxfp8_ct", "(MXFP8)"),
                                           ("fp8_kv_ct", "weights strategy 'tensor'")])
def test_compressed_tensors_schemes_tensorrt_llm_does_not_read_are_refused(exports, name, refusal):
    report = check_checkpoint(exports["out"] / name, engine="trtllm")
    assert _rules(report) == {"scheme": {"trtllm x compressed-tensors"}}, report.details()
    assert refusal in report.verdict(), report.verdict()


def test_per_channel_fp8_without_per_token_inputs_is_an_error_for_tensorrt_llm_naming_the_field(exports):
    """TensorRT-LLM's compressed-tensors reader takes per-channel FP8 weights only with per-token inputs."""

    def config(cfg):
        group = cfg["quantization_config"]["config_groups"]["group_0"]
        group["input_activations"] = {**group["input_activations"], "strategy": "tensor"}

    path = _planted(exports, "fp8_dynamic_ct", lambda t: None, config)
    report = check_checkpoint(path, engine="trtllm")
    assert _rules(report) == {"scheme": {"model.layers.0.mlp.experts.0.down_proj input_activations"}}, report.details()
    assert "strategy 'tensor'" in report.errors[0].message
    assert "['token']" in report.errors[0].message
    assert check_checkpoint(path, engine="vllm").ok


def test_block_fp8_of_model_optimizer_is_refused_for_tensorrt_llm(exports):
    report = check_checkpoint(exports["out"] / "fp8_block_modelopt", engine="trtllm")
    assert _rules(report) == {"scheme": {"trtllm x modelopt"}}, report.details()
    assert "FP8_BLOCK_SCALES" in report.verdict()


def _replaced(name: str, how):
    """An edit that replaces tensor ``name`` by ``how(tensor)``."""
    return lambda t: t.update({name: how(t[name])})


PLANTED = {  # (export, edit, error rule, tensor, words of the message)
    "fp8_dynamic zero channel scale": ("fp8_dynamic_ct", lambda t: t[f"{EXPERT}.up_proj.weight_scale"][3].zero_(),
                                       "scale", f"{EXPERT}.up_proj.weight_scale", "[3] 0 is not positive"),
    "fp8_dynamic [R, 1] where Model Optimizer stores [R]": (
        "fp8_dynamic_modelopt", _replaced(f"{EXPERT}.down_proj.weight_scale", lambda v: v.reshape(-1, 1)),
        "shape", f"{EXPERT}.down_proj.weight_scale", "expected [64]"),
    "w4a16 deleted group scale": ("w4a16_ct", lambda t: t.pop(f"{EXPERT}.gate_proj.weight_scale"), "missing",
                                  f"{EXPERT}.gate_proj.weight_scale", "absent"),
    "w4a16 denormal group scale": ("w4a16_ct", lambda t: t[f"{EXPERT}.down_proj.weight_scale"][0, 0].fill_(1e-40),
                                   "scale", f"{EXPERT}.down_proj.weight_scale", "subnormal"),
    "w4a16 packed in int64": ("w4a16_ct", _replaced(f"{EXPERT}.up_proj.weight_packed", torch.Tensor.long),
                              "dtype", f"{EXPERT}.up_proj.weight_packed", "I64, expected I32"),
    "w4a16 weight_shape of another matrix": (
        "w4a16_ct", lambda t: t[f"{EXPERT}.up_proj.weight_shape"].fill_(16), "shape", f"{EXPERT}.up_proj.weight_shape",
        "expected the weight's [32, 64]"),
    "mxfp4 NaN E8M0 scale": ("mxfp4_ct", lambda t: t[f"{EXPERT}.gate_proj.weight_scale"][1, 0].fill_(255), "scale",
                             f"{EXPERT}.gate_proj.weight_scale", "encodes NaN"),
    "mxfp4 scales per 16": ("mxfp4_ct", _replaced(f"{EXPERT}.down_proj.weight_scale",
                                                    lambda v: v.repeat_interleave(2, 1)),
                            "shape", f"{EXPERT}.down_proj.weight_scale", "expected [64, 1]"),
    "mxfp8 scales as fp32": ("mxfp8_ct", _replaced(f"{EXPERT}.up_proj.weight_scale", torch.Tensor.float),
                             "dtype", f"{EXPERT}.up_proj.weight_scale", "F32, expected U8"),
    "mxfp8 deleted scale": ("mxfp8_modelopt", lambda t: t.pop(f"{ATTN}.o_proj.weight_scale"), "missing",
                            f"{ATTN}.o_proj.weight_scale", "absent"),
    "fp8_block zero block scale": ("fp8_block_ct", lambda t: t[f"{EXPERT}.gate_proj.weight_scale"][0, 1].zero_(),
                                   "scale", f"{EXPERT}.gate_proj.weight_scale", "[1] 0 is not positive"),
    "fp8_block 2-D grid where Model Optimizer stores 4-D": (
        "fp8_block_modelopt", _replaced(f"{EXPERT}.down_proj.weight_scale", lambda v: v[:, 0, :, 0].contiguous()),
        "shape", f"{EXPERT}.down_proj.weight_scale", "expected [2, 1, 1, 1]"),
    "kv missing k_scale": ("fp8_kv_ct", lambda t: t.pop(f"{ATTN}.k_scale"), "missing", f"{ATTN}.k_scale", "absent"),
    "kv zero v_scale": ("fp8_kv_modelopt", lambda t: t[f"{ATTN}.v_proj.v_scale"].zero_(), "scale",
                        f"{ATTN}.v_proj.v_scale", "not positive"),
    "kv denormal k_scale": ("fp8_kv_modelopt", lambda t: t[f"{ATTN}.k_proj.k_scale"].fill_(1e-39), "scale",
                            f"{ATTN}.k_proj.k_scale", "subnormal"),
    "kv k_scale of several values": ("fp8_kv_ct", _replaced(f"{ATTN}.v_scale", lambda v: v.repeat(2)),
                                     "shape", f"{ATTN}.v_scale", "expected [] or [1]"),
}


@pytest.mark.parametrize("case", list(PLANTED))
def test_planted_defect_is_an_error_naming_the_tensor(exports, case):
    name, edit, rule, tensor, words = PLANTED[case]
    path = _planted(exports, name, edit)
    for engine in EXPORTS[name][3]:
        report = check_checkpoint(path, engine=engine)
        assert _rules(report) == {rule: {tensor}}, report.details()
        assert words in str(report.errors[0]), report.details()
        assert report.verdict().startswith(f"check {engine}: FAIL"), report.verdict()


def test_kv_cache_scales_without_a_quantized_kv_cache_are_a_warning(exports):
    def no_kv(cfg):
        cfg["quantization_config"]["kv_cache_scheme"] = None

    report = check_checkpoint(_planted(exports, "fp8_kv_ct", lambda t: None, no_kv), engine="vllm")
    assert report.ok, report.details()
    assert [f.rule for f in report.warnings] == ["kv_cache"], report.details()


def test_per_channel_experts_with_static_inputs_are_an_error_for_vllm(exports):
    """The compressed-tensors FP8 MoE method of vLLM takes per-channel expert weights only with per-token inputs."""

    def static_inputs(t):
        for name in [k.removesuffix(".weight_scale") for k in t if k.endswith(".weight_scale")]:
            t[name + ".input_scale"] = torch.ones(1)

    def config(cfg):
        group = cfg["quantization_config"]["config_groups"]["group_0"]
        group["input_activations"] = {**group["input_activations"], "strategy": "tensor", "dynamic": False}

    path = _planted(exports, "fp8_dynamic_ct", static_inputs, config)
    assert _rules(check_checkpoint(path, engine="vllm")) == {"scheme": {"layer 0 experts", "layer 1 experts"}}
    assert check_checkpoint(path, engine="sglang").ok


def _ct_w4a16(hf_dir: Path, out: Path) -> None:
    """The bf16 checkpoint as W4A16 groups of 32 by compressed-tensors' own PackedQuantizationCompressor (absmax
    group scales; router and lm_head ignored), with its own quantization config."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme
    from safetensors.torch import load_file, save_file

    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme.weights.group_size = 32
    tensors = load_file(hf_dir / "model.safetensors")
    ignore = [k.removesuffix(".weight") for k in tensors if k.endswith("mlp.gate.weight") or k == "lm_head.weight"]
    linears = [k.removesuffix(".weight") for k in tensors if k.endswith("proj.weight")]
    out_tensors = {k: t for k, t in tensors.items() if k.removesuffix(".weight") not in linears}
    for m in linears:
        w = tensors[m + ".weight"].float()
        scale = (w.unflatten(-1, (-1, 32)).abs().amax(-1) / 7.5).clamp(min=torch.finfo(torch.float32).eps)
        local = {"weight": w, "weight_scale": scale, "weight_zero_point": torch.zeros_like(scale, dtype=torch.int8)}
        for k, v in PackedQuantizationCompressor.compress(local, scheme).items():
            out_tensors[f"{m}.{k}"] = v
    out.mkdir()
    save_file(out_tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((hf_dir / "config.json").read_text())
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized", ignore=ignore,
                            quantization_status=QuantizationStatus.COMPRESSED)
    cfg["quantization_config"] = qc.model_dump(mode="json") | {"quant_method": "compressed-tensors"}
    (out / "config.json").write_text(json.dumps(cfg))


def test_a_w4a16_checkpoint_of_compressed_tensors_own_compressor_passes(exports):
    out = exports["base"] / "ct_own_w4a16"
    _ct_w4a16(Path(exports["hf"]["narrow"]), out)
    for engine in ("vllm", "sglang"):
        report = check_checkpoint(out, engine=engine)
        print(report.details())
        assert report.ok, report.details()
        assert not report.warnings, report.details()
        assert report.schemes == {"int4_groups_a16": LAYERS * (4 + 3 * EXPERTS)}


def _layer_counts(tokens: dict, layer: int, gemm: str) -> list[int]:
    cells = tokens[f"decoder.layers.{layer}.mlp.experts.{gemm}.input_quantizer"]
    return [cells[e] for e in range(EXPERTS)]


def test_calibration_tokens_are_written_per_expert_and_reported_by_the_cli(exports):
    path = exports["out"] / "fp8_kv_modelopt"
    tokens = exports["tokens"]["fp8_kv"]
    data = json.loads((path / "calibration_tokens.json").read_text())
    assert data["min_tokens"] == 32
    for layer in range(LAYERS):
        fc1, fc2 = _layer_counts(tokens, layer, "linear_fc1"), _layer_counts(tokens, layer, "linear_fc2")
        for e in range(EXPERTS):
            prefix = f"model.layers.{layer}.mlp.experts.{e}"
            assert data["experts"][f"{prefix}.gate_proj"] == data["experts"][f"{prefix}.up_proj"] == fc1[e]
            assert data["experts"][f"{prefix}.down_proj"] == fc2[e]
    assert sum(_layer_counts(tokens, 0, "linear_fc1")) == 2 * 2 * 16 * 2  # every token at top-2
    cli = [sys.executable, "-m", "modelopt_moe.plugins.cli", "check"]
    done = subprocess.run(cli + [str(path), "--engine", "vllm", "--details"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for layer in range(LAYERS):
        counts = _layer_counts(tokens, layer, "linear_fc1")
        low = min(range(EXPERTS), key=counts.__getitem__)
        line = f"layer {layer} gate_up: min {counts[low]} (expert {low}), median {statistics.median(counts):g}"
        assert line in done.stdout, done.stdout
    # an expert no calibration token reached (the file edited): flagged, still a PASS (the engines load its scale)
    cold = _planted(exports, "fp8_kv_modelopt", lambda t: None)
    data["experts"][f"{EXPERT}.down_proj"] = 0
    (cold / "calibration_tokens.json").write_text(json.dumps(data))
    flagged = subprocess.run(cli + [str(cold), "--engine", "sglang"], capture_output=True, text=True, timeout=120)
    assert flagged.returncode == 0, flagged.stdout + flagged.stderr
    assert flagged.stdout.startswith("check sglang: PASS"), flagged.stdout
    assert "calibration tokens per expert: min 0 (layer " in flagged.stdout, flagged.stdout
    details = subprocess.run(cli + [str(cold), "--engine", "sglang", "--details"], capture_output=True, text=True,
                             timeout=120)
    line = next(x for x in details.stdout.splitlines() if x.strip().startswith("layer 1 down: min 0 (expert 2)"))
    assert "FLAGGED, below 32" in line, details.stdout
    assert "2: 0" in line, details.stdout
    # export without per-expert token counts (MX inputs are dynamic): no file, nothing reported
    assert not (exports["out"] / "mxfp4_ct" / "calibration_tokens.json").exists()


def test_weight_blocks_across_the_fused_gate_and_up_are_an_error(exports):
    """Blocks of 256 rows over experts whose gate and up have 128 rows each: vLLM and SGLang stack gate and up into
    one weight and refuse a block that straddles them."""
    def tall_blocks(cfg):
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["block_structure"] = [256, 128]

    path = _planted(exports, "fp8_block_ct", lambda t: None, tall_blocks)
    for engine in ("vllm", "sglang"):
        report = check_checkpoint(path, engine=engine)
        layers = {f.where for f in report.errors if "not a multiple of the 256-row weight block" in f.message}
        assert layers == {"layer 0 experts", "layer 1 experts"}, report.details()
