"""The engine-contract checker (``modelopt_moe.export.check_checkpoint``, ``modelopt-moe check``) on real exports.

One single-rank spawn imports tiny random Qwen3-MoE and Mixtral models (written by transformers) into Megatron,
quantizes them (FP8 W8A8 and NVFP4 W4A4, one input amax per expert) and exports them in both formats through the
public API. Every export passes every engine that reads it (TensorRT-LLM's compressed-tensors reader refuses
per-tensor FP8, and the checker says so); defects planted into copies of them (a deleted expert scale, a zero
scale, a denormal scale, gate != up where the engine needs them equal, a wrong dtype, a missing ``quantized_layers``
entry of a Model Optimizer mixed-precision config) are each found, naming the tensor. A checkpoint written by
compressed-tensors' own compressors from the same bf16 weights passes too.
"""

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from limits import seconds  # noqa: E402

from modelopt_moe.export import check_checkpoint
from modelopt_moe.launch import spawn

LAYERS, EXPERTS, INTER, HIDDEN = 2, 4, 32, 64
EXPORTS = {  # name -> (family, config file, format)
    "qwen3_fp8_ct": ("qwen3_moe", "fp8_per_expert.yaml", "compressed-tensors"),
    "qwen3_fp8_modelopt": ("qwen3_moe", "fp8_per_expert.yaml", "modelopt"),
    "qwen3_nvfp4_ct": ("qwen3_moe", "nvfp4_default.yaml", "compressed-tensors"),
    "qwen3_nvfp4_modelopt": ("qwen3_moe", "nvfp4_default.yaml", "modelopt"),
    "mixtral_nvfp4_modelopt": ("mixtral", "nvfp4_default.yaml", "modelopt"),
}
ENGINES = ("vllm", "sglang", "trtllm")
REFUSED = ("qwen3_fp8_ct", "trtllm")  # TensorRT-LLM reads no per-tensor FP8 compressed-tensors checkpoint
EXPERT = "model.layers.1.mlp.experts.2"


def _make_hf(path: Path, family: str) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64)
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(head_dim=16, num_experts=EXPERTS, moe_intermediate_size=INTER,
                                                   **common))
    else:
        model = MixtralForCausalLM(MixtralConfig(num_local_experts=EXPERTS, intermediate_size=INTER, **common))
    model.to(torch.bfloat16).save_pretrained(path)


def _export(rank, world, paths: dict) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import tensor_parallel

    import modelopt_moe.quantization as mtq
    from modelopt_moe.export import build_megatron_model, export_hf, import_hf, save_hf_config
    from modelopt_moe.plugins.megatron import init_model_parallel, save_sharded_checkpoint

    init_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 128, (2, 16), generator=g) for _ in range(2)]
    held_out, reference = [torch.randint(0, 128, (2, 16), generator=g) for _ in range(2)], {}

    def logits(m, b):
        seq = b.shape[1]
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
        with torch.no_grad():
            return m(b, torch.arange(seq).expand_as(b), mask, runtime_gather_output=True).float()

    def calibrate(m):
        for b in batches:
            logits(m, b)

    for name, (family, config, fmt) in EXPORTS.items():
        m = build_megatron_model(paths[family], perform_initialization=False, params_dtype=torch.float32)
        import_hf(m, paths[family])
        cfg = mtq.load_config(config)
        cfg.experts.input_amax = "per_expert"
        mtq.quantize(m.eval(), cfg, calibrate)
        export_hf(m, Path(paths["out"]) / name, format=fmt, progress=False)
        reference[name] = [(b, logits(m, b)) for b in held_out]
        if name == "qwen3_nvfp4_modelopt":  # what `modelopt-moe export` starts from
            save_sharded_checkpoint(m, paths["ckpt"])
            save_hf_config(paths[family], paths["ckpt"])
    return reference


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    base = tmp_path_factory.mktemp("check")
    paths = {"out": str(base / "out"), "ckpt": str(base / "ckpt")}
    for family in ("qwen3_moe", "mixtral"):
        paths[family] = str(base / family)
        _make_hf(base / family, family)
    (reference,) = spawn(_export, 1, args=(paths,), timeout=seconds(600))
    return {"base": base, "out": base / "out", "hf": paths, "reference": reference, "ckpt": base / "ckpt"}


def _planted(exports, name: str, edit, config_edit=None) -> Path:
    """A copy of export ``name`` with ``edit(tensors)`` applied to every shard's tensors (dropped keys leave the
    index too) and ``config_edit(config)`` to its config.json."""
    from safetensors.torch import load_file, save_file

    dst = Path(tempfile.mkdtemp(dir=exports["base"])) / name
    shutil.copytree(exports["out"] / name, dst)
    dropped = set()
    for shard in sorted(dst.glob("*.safetensors")):
        tensors = load_file(shard)
        before = set(tensors)
        edit(tensors)
        dropped |= before - set(tensors)
        save_file(tensors, shard, metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if k not in dropped}
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


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", list(EXPORTS))
def test_our_exports_pass_every_engine_that_reads_them(exports, name, engine):
    report = check_checkpoint(exports["out"] / name, engine=engine)
    print(report.details())
    if (name, engine) == REFUSED:  # what the refusal says: its own test below
        assert not report.ok, report.details()
        return
    assert report.ok, report.details()
    assert sum(report.schemes.values()) == LAYERS * (4 + 3 * EXPERTS)
    assert len(report.spreads) == 2 * LAYERS  # per layer: gate_up and down
    assert all(s.worst_ratio >= 1.0 for s in report.spreads)
    if report.collapse == "layer":  # one input amax per expert in training, one per layer in the engine
        assert max(s.worst_ratio for s in report.spreads) > 1.0


def test_per_tensor_fp8_of_compressed_tensors_is_refused_for_tensorrt_llm(exports):
    """TensorRT-LLM's compressed-tensors reader takes 8-bit weights per channel or per block only."""
    report = check_checkpoint(exports["out"] / REFUSED[0], engine=REFUSED[1])
    assert _rules(report) == {"scheme": {"trtllm x compressed-tensors"}}, report.details()
    assert "weights strategy 'tensor'" in report.verdict()
    assert check_checkpoint(exports["out"] / "qwen3_fp8_modelopt", engine="trtllm").ok


def test_an_engine_without_a_loader_for_the_scheme_does_not_fail_the_export(exports):
    """The export's one-line verdict: TensorRT-LLM refusing FP8 per-tensor compressed-tensors is ``REFUSES``, named
    with its reason, and the export still passes (vLLM and SGLang read it); only a broken contract fails it."""
    from modelopt_moe.export.check import check_all_engines

    passed, line = check_all_engines(exports["out"] / REFUSED[0])
    assert passed, line
    assert line.startswith("check vllm PASS, sglang PASS, trtllm REFUSES ("), line
    assert "weights strategy 'tensor'" in line, line


@pytest.mark.parametrize("name", ["qwen3_fp8_ct", "qwen3_nvfp4_modelopt", "mixtral_nvfp4_modelopt"])
def test_engine_order_forward_from_the_files_matches_the_fake_quant_model(exports, name):
    """With each expert's own input scale, the files run in engine order give the fake-quant model's distribution
    (fp32 rounding only); with an engine's collapsed scales the KL says what serving it there costs."""
    from modelopt_moe.export.engine_forward import engine_order_kl

    reference = exports["reference"][name]
    own = engine_order_kl(exports["out"] / name, reference)
    assert max(own) < 1e-6, own
    for engine in ENGINES:
        if (name, engine) == REFUSED:
            continue
        report = check_checkpoint(exports["out"] / name, engine=engine, reference=reference)
        print(report.verdict())
        assert report.ok, report.details()
        assert len(report.kl) == 2, report.kl
        assert min(report.kl) >= -1e-12, report.kl
        assert max(report.kl) < 0.05, report.kl
        assert "engine-order forward KL to the reference" in report.verdict()


def test_deleted_expert_input_scale_is_an_error_naming_it(exports):
    missing = f"{EXPERT}.down_proj.input_scale"
    path = _planted(exports, "qwen3_nvfp4_modelopt", lambda t: t.pop(missing))
    for engine in ENGINES:
        report = check_checkpoint(path, engine=engine)
        assert _rules(report) == {"missing": {missing}}, report.details()
        assert "NaN" in report.verdict()


def test_zero_weight_scale_is_an_error(exports):
    name = f"{EXPERT}.gate_proj.weight_scale"
    path = _planted(exports, "qwen3_fp8_ct", lambda t: t[name].zero_())
    report = check_checkpoint(path, engine="vllm")
    assert _rules(report) == {"scale": {name}}, report.details()
    assert "not positive" in report.errors[0].message


def test_denormal_input_scale_is_an_error(exports):
    name = f"{EXPERT}.up_proj.input_scale"
    path = _planted(exports, "qwen3_fp8_modelopt", lambda t: t[name].fill_(1e-40))
    report = check_checkpoint(path, engine="sglang")
    assert _rules(report) == {"scale": {name}}, report.details()
    assert "subnormal" in report.errors[0].message


def test_gate_up_global_scales_differ_is_an_error_where_the_engine_fuses_them(exports):
    gate, up = f"{EXPERT}.gate_proj", f"{EXPERT}.up_proj"

    def edit(t):
        t[up + ".weight_scale_2"].mul_(2.0)

    path = _planted(exports, "qwen3_nvfp4_modelopt", edit)
    for engine in ENGINES:
        report = check_checkpoint(path, engine=engine)
        assert _rules(report) == {"gate_up": {f"{gate} / {up}"}}, report.details()
    # FP8 experts: the engines requantize onto the larger scale, a warning with the ratio
    path = _planted(exports, "qwen3_fp8_ct", lambda t: t[up + ".weight_scale"].mul_(2.0))
    report = check_checkpoint(path, engine="vllm")
    assert report.ok, report.details()
    assert [f.rule for f in report.warnings] == ["gate_up"], report.details()
    assert "2x coarser" in report.warnings[0].message


def test_wrong_dtype_is_an_error(exports):
    name = f"{EXPERT}.down_proj.weight"
    path = _planted(exports, "qwen3_fp8_ct", lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    report = check_checkpoint(path, engine="vllm")
    assert _rules(report) == {"dtype": {name}}, report.details()
    assert "BF16, expected F8_E4M3" in report.errors[0].message


def test_modelopt_mixed_precision_needs_every_quantized_layer_listed(exports):
    src = exports["out"] / "qwen3_nvfp4_modelopt"
    cfg = json.loads((src / "config.json").read_text())["quantization_config"]
    modules = sorted({k.rsplit(".", 1)[0] for k in json.loads((src / "model.safetensors.index.json").read_text())
                      ["weight_map"] if k.endswith(".weight_scale_2")})

    def mixed(drop):
        def edit(c):
            c["quantization_config"] = {**cfg, "quant_algo": "MIXED_PRECISION", "quantized_layers": {
                m: {"quant_algo": "NVFP4", "group_size": 16} for m in modules if m != drop}}
        return edit

    complete = _planted(exports, "qwen3_nvfp4_modelopt", lambda t: None, mixed(None))
    assert check_checkpoint(complete, engine="vllm").ok
    dropped = f"{EXPERT}.up_proj"
    path = _planted(exports, "qwen3_nvfp4_modelopt", lambda t: None, mixed(dropped))
    report = check_checkpoint(path, engine="vllm")
    assert _rules(report) == {"quantized_layers": {dropped}}, report.details()


def test_cli_prints_the_verdict_and_exits_1_on_a_defect(exports):
    cli = [sys.executable, "-m", "modelopt_moe.plugins.cli", "check"]
    good = subprocess.run(cli + [str(exports["out"] / "qwen3_nvfp4_ct"), "--engine", "vllm"], capture_output=True,
                          text=True, timeout=120)
    assert good.returncode == 0, good.stderr
    assert good.stdout.startswith("check vllm: PASS (compressed-tensors: 32 nvfp4_blocks;"), good.stdout
    name = f"{EXPERT}.gate_proj.input_global_scale"
    bad_dir = _planted(exports, "qwen3_nvfp4_ct", lambda t: t[name].fill_(float("inf")))
    bad = subprocess.run(cli + [str(bad_dir), "--details"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert bad.stdout.count("FAIL") == 3, bad.stdout
    assert name in bad.stdout
    assert "not finite" in bad.stdout
    assert "input scales per MoE layer" in bad.stdout
    usage = subprocess.run(cli + [str(exports["base"]), "--engine", "vllm"], capture_output=True, text=True,
                           timeout=120)
    assert usage.returncode == 2, usage.stderr
    assert "config" in usage.stderr


def test_modelopt_moe_export_ends_with_the_check_verdict(exports):
    out = exports["base"] / "cli_export"
    done = subprocess.run([sys.executable, "-m", "modelopt_moe.plugins.cli", "export", "--checkpoint",
                           str(exports["ckpt"]), "--format", "modelopt", "--out", str(out), "--dtype", "float32"],
                          capture_output=True, text=True, timeout=seconds(300))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last == "check vllm PASS, sglang PASS, trtllm PASS (modelopt: 32 nvfp4_blocks; 0 warnings)", done.stdout


def _ct_compressed(hf_dir: Path, out: Path, scheme_name: str, fuse_gate_up: bool) -> None:
    """The bf16 checkpoint quantized by compressed-tensors' own compressors (absmax scales, every expert and
    attention linear; router and lm_head ignored), written with its own quantization config. ``fuse_gate_up``: each
    expert's gate and up share their per-tensor scale (the max of the two), as llm-compressor's calibration does for
    the engines' fused gate/up GEMM."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme
    from safetensors.torch import load_file, save_file

    scheme = preset_name_to_scheme(scheme_name, ["Linear"])
    fmt = "float-quantized" if scheme_name == "FP8" else "nvfp4-pack-quantized"
    compressor = BaseCompressor.get_value_from_registry(fmt)
    tensors = load_file(hf_dir / "model.safetensors")
    ignore = [k.removesuffix(".weight") for k in tensors if k.endswith("mlp.gate.weight") or k == "lm_head.weight"]
    linears = [k.removesuffix(".weight") for k in tensors if k.endswith("proj.weight")]
    amax = {m: tensors[m + ".weight"].float().abs().amax() for m in linears}
    if fuse_gate_up:
        for m in linears:
            if m.endswith("gate_proj") and ".experts." in m:
                up = m.removesuffix("gate_proj") + "up_proj"
                amax[m] = amax[up] = torch.maximum(amax[m], amax[up])
    out_tensors = {k: t for k, t in tensors.items() if k.removesuffix(".weight") not in linears}
    for m in linears:
        w = tensors[m + ".weight"].float()
        if scheme_name == "FP8":
            local = {"weight": w, "weight_scale": (amax[m] / 448).reshape(1), "input_scale": torch.tensor([0.01])}
        else:
            gs = (448 * 6 / amax[m]).reshape(1)
            blocks = w.reshape(w.shape[0], -1, 16).abs().amax(-1) / 6
            local = {"weight": w, "weight_global_scale": gs,
                     "weight_scale": (blocks * gs).to(torch.float8_e4m3fn).float(),
                     "input_global_scale": torch.tensor([448 * 6 / 4.0])}
        for k, v in compressor.compress(local, scheme).items():
            out_tensors[f"{m}.{k}"] = v
    out.mkdir()
    save_file(out_tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((hf_dir / "config.json").read_text())
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=ignore,
                            quantization_status=QuantizationStatus.COMPRESSED)
    cfg["quantization_config"] = qc.model_dump(mode="json") | {"quant_method": "compressed-tensors"}
    (out / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("scheme", ["FP8", "NVFP4"])
def test_a_checkpoint_of_compressed_tensors_own_compressor_passes(exports, scheme):
    out = exports["base"] / f"ct_own_{scheme}"
    _ct_compressed(Path(exports["hf"]["qwen3_moe"]), out, scheme, fuse_gate_up=True)
    for engine in ("vllm", "sglang"):
        report = check_checkpoint(out, engine=engine)
        print(report.details())
        assert report.ok, report.details()
        assert not report.warnings, report.details()
        assert sum(report.schemes.values()) == LAYERS * (4 + 3 * EXPERTS)


def test_compressed_tensors_scales_per_linear_leave_gate_and_up_apart(exports):
    """Without a shared gate/up scale, the same compressor's NVFP4 experts fail: vLLM would dequantize every up
    projection with its gate's global scale; FP8 experts are requantized (a warning)."""
    for scheme in ("FP8", "NVFP4"):
        out = exports["base"] / f"ct_own_unfused_{scheme}"
        _ct_compressed(Path(exports["hf"]["qwen3_moe"]), out, scheme, fuse_gate_up=False)
        report = check_checkpoint(out, engine="vllm")
        findings = report.errors if scheme == "NVFP4" else report.warnings
        assert report.ok == (scheme == "FP8"), report.details()
        assert len(findings) == LAYERS * EXPERTS, report.details()
        assert {f.rule for f in findings} == {"gate_up"}
