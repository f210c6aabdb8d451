"""Trained as served: the exported checkpoint, run the way serving engines run it, gives the Megatron fake-quant
model's logits.

Serving engines (vLLM, SGLang, TensorRT-LLM, transformers) multiply the router probability into an expert's output
after ``down_proj``, whose input, ``act(gate_up(x))``, they quantize with the exported static input scale; Megatron's
expert MLPs multiply it in before ``linear_fc2``. The fake-quant forward must quantize that operand where the
engines do, or the exported down_proj input scale clips what the engines feed it.

One spawn (4 gloo ranks) builds tiny random Qwen3-MoE and Mixtral models (written by transformers; 3 layers, 8
experts, top-2) at TP1 x EP4 and TP2 x EP2, imports them into Megatron, quantizes them (FP8 W8A8, NVFP4 W4A4 and NVFP4
W4A4 with 4-over-6 block scales on weights and inputs, one input amax per expert), exports compressed-tensors
checkpoints and records the fake-quant logits, through the public API as a training script does (on CPU, Megatron
also needs the shims of ``megatron_cpu``); it also measures the down_proj input amax in both orders at top-8 of 64
experts.

The engine emulation in the parent process is the library's engine-order reference forward
(``modelopt_moe.export.engine_forward.engine_order_model``, which ``check_checkpoint`` also runs), built from the
exported files alone: transformers supplies the architecture, every quantized weight is decoded from the exported
codes and scales with the formats' documented formulas, the fused experts become per-expert ``nn.Linear`` modules
running transformers' own expert loop (probability after ``down_proj``), and a forward pre-hook on every quantized
linear quantizes the linear's input with the exported static scale, the way the engines' kernels do.
"""

from pathlib import Path

import pytest
import torch
from limits import seconds  # noqa: E402
from torch import nn

from modelopt_moe.export.engine_forward import engine_order_model
from modelopt_moe.launch import spawn

WORLD, LAYERS, EXPERTS, TOPK, HIDDEN, INTER = 4, 3, 8, 2, 64, 32
LAYOUTS = ((1, 4), (2, 2))  # (TP, EP)
FAMILIES = ("qwen3_moe", "mixtral")
SCHEMES = {"fp8": "fp8_per_expert.yaml", "nvfp4": "nvfp4_default.yaml", "nvfp4_4o6": "nvfp4_4o6.yaml"}
# NVFP4 with 4-over-6 block scales from the data on weights and inputs (written by the parent beside the models): the
# export marks the inputs, and the engine-order forward runs them with the 4-over-6 rule.
_FOUR_OVER_SIX = "{num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3, four_over_six: true}}"
FOUR_OVER_SIX_YAML = (f'quant_cfg:\n  - quantizer_name: "*weight_quantizer"\n    cfg: {_FOUR_OVER_SIX}\n'
                      f'  - quantizer_name: "*input_quantizer"\n    cfg: {_FOUR_OVER_SIX}\n'
                      "  - $import: _default_tail.yaml\nalgorithm: max\n")
WIDE = "qwen3_moe_top8of64"  # the amax-ratio measurement: top-8 of 64 experts
# Both sides compute the same quantized model; what differs is fp32 rounding: GEMMs in another order, the engine's
# scales from the reciprocals the files store (x / input_scale instead of x * 448 / amax). Measured 2e-7 to 3e-7 for
# FP8 and NVFP4 alike at every layout (a down_proj input scale calibrated on prob * act gives 2.5-4% for FP8 and
# 9-15% for NVFP4 here).
FP8_TOLERANCE = 1e-3
# NVFP4 activations round to E2M1 ({0, .5, 1, 1.5, 2, 3, 4, 6} times a block scale per 16 values), and the engine
# derives each block scale from the stored reciprocal global scale (``gs * blockmax / 6``, training ``blockmax / 6 /
# sg``): a value within an fp32 ulp of an E2M1 rounding midpoint, or a block scale at an E4M3 midpoint, can round the
# other way on other data and move by a whole step (up to a third of its block's largest value). None did here; the
# tolerance leaves room for a few such flips and is still 10x below the misplaced scale's error.
NVFP4_TOLERANCE = 1e-2


def _make_hf(path: Path, family: str, num_experts: int = EXPERTS, top_k: int = TOPK) -> None:
    """A tiny random model of ``family`` saved by transformers in bf16 (norms perturbed so their mapping shows)."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0 if family == "qwen3_moe" else 1)
    common = dict(vocab_size=128, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=top_k, max_position_embeddings=64)
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(head_dim=16, num_experts=num_experts, moe_intermediate_size=INTER,
                                                   norm_topk_prob=True, **common))
    else:
        model = MixtralForCausalLM(MixtralConfig(num_local_experts=num_experts, intermediate_size=INTER, **common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.to(torch.bfloat16).save_pretrained(path)


# ------------------------------------------------------------------------------------------------ ranks


def _down_proj_input_amax(m, forward, quantize) -> dict:
    """Every global expert's down_proj input amax over the calibration data, per (layer, expert): in the engines'
    order (``act``, from each expert's ``linear_fc1`` output, as Megatron's GLU computes it) and in Megatron's order
    (``prob * act``, the input ``linear_fc2`` gets), both recorded by hooks on the unquantized model; then the amax
    calibration gives the fc2 input quantizer on the same data."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state

    ep_rank, offset = parallel_state.get_expert_model_parallel_rank(), m.config.glu_linear_offset
    seen = {"engine": {}, "megatron": {}}
    hooks = []

    def record(order, key, t):
        seen[order][key] = max(seen[order].get(key, 0.0), t.detach().abs().max().item() if t.numel() else 0.0)

    for li, layer in enumerate(m.decoder.layers):
        experts = layer.mlp.experts
        for i, expert in enumerate(experts.local_experts):
            key = (li, ep_rank * experts.num_local_experts + i)
            hooks.append(expert.linear_fc1.register_forward_hook(
                lambda mod, args, out, key=key: record("engine", key, _glu(out[0], offset, F.silu))))
            hooks.append(expert.linear_fc2.register_forward_pre_hook(
                lambda mod, args, key=key: record("megatron", key, args[0])))
    forward(m)
    for h in hooks:
        h.remove()
    quantize(m)
    for li, layer in enumerate(m.decoder.layers):
        q = layer.mlp.experts.linear_fc2.input_quantizer
        for i in range(q.num_experts):
            seen.setdefault("calibrated", {})[(li, ep_rank * q.num_experts + i)] = q.expert_amax(i).item()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, seen)
    return {order: {k: v for part in parts for k, v in part[order].items()} for order in seen}


def _glu(fc1_out, offset, act):
    gate, up = torch.chunk(fc1_out, 2, dim=-1)
    return act(gate) * (up + offset)


def _setup(tp: int, ep: int) -> None:
    """Megatron's model-parallel state (expert TP 1) and RNG trackers, as a training script sets them up."""
    from megatron.core import parallel_state, tensor_parallel

    from modelopt_moe.plugins.megatron_cpu import apply_cpu_shims

    apply_cpu_shims()  # Megatron on a CPU-only machine (a no-op with CUDA)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=1)
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)


def _batches(n: int, batch: int = 2, seq: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (batch, seq), generator=g) for _ in range(n)]


def _logits(m, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits of the Megatron GPT (causal mask, positions 0..seq-1), the same on every rank."""
    seq = tokens.shape[1]
    positions = torch.arange(seq).expand_as(tokens)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        return m(tokens, positions, mask, runtime_gather_output=True).float()


def _rank(rank, world, paths: dict) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    import modelopt_moe.quantization as mtq
    from modelopt_moe.export import build_megatron_model, export_hf, import_hf

    out = Path(paths["out"])
    batches = _batches(3)
    res: dict = {"tokens": batches[2]}

    def calibrate(m):
        for b in batches[:2]:
            _logits(m, b)

    def imported(hf_dir):
        m = build_megatron_model(hf_dir, perform_initialization=False, params_dtype=torch.float32)
        import_hf(m, hf_dir)
        return m.eval()

    def quantize(m, scheme="fp8"):
        cfg = mtq.load_config(paths.get(scheme, SCHEMES[scheme]))
        cfg.experts.input_amax = "per_expert"
        return mtq.quantize(m, cfg, calibrate)

    for tp, ep in LAYOUTS:
        _setup(tp, ep)
        for family in FAMILIES:
            for scheme in SCHEMES:
                m = quantize(imported(paths[family]), scheme)
                name = f"{family}_{scheme}_tp{tp}ep{ep}"
                export_hf(m, out / name, format="compressed-tensors", progress=False)
                res[name] = _logits(m, batches[2])
        parallel_state.destroy_model_parallel()
    _setup(1, 4)
    res["amax"] = _down_proj_input_amax(imported(paths[WIDE]), calibrate, quantize)
    parallel_state.destroy_model_parallel()
    return res


# ------------------------------------------------------------------------------------------------ engine emulation


def _engine_model(path: Path) -> nn.Module:
    """The exported checkpoint run in engine order from its files, every quantized linear's input quantized with its
    own exported static scale (what the fake quant trained: one input amax per expert)."""
    model = engine_order_model(path)
    hooked = [m for m in model.modules() if isinstance(m, nn.Linear) and m._forward_pre_hooks]
    assert len(hooked) == LAYERS * (4 + 3 * EXPERTS)  # q, k, v, o and every expert's three
    return model


def _relative_max_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("engine_order")
    paths = {"out": str(base / "out")}
    (base / "out").mkdir()
    for family in FAMILIES:
        paths[family] = str(base / family)
        _make_hf(base / family, family)
    paths[WIDE] = str(base / WIDE)
    _make_hf(base / WIDE, "qwen3_moe", num_experts=64, top_k=8)
    paths["nvfp4_4o6"] = str(base / SCHEMES["nvfp4_4o6"])
    (base / SCHEMES["nvfp4_4o6"]).write_text(FOUR_OVER_SIX_YAML)
    results = spawn(_rank, WORLD, args=(paths,), timeout=seconds(900))
    return {"base": base, "paths": paths, "r0": results[0]}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda tp_ep: f"tp{tp_ep[0]}ep{tp_ep[1]}")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_engine_order_logits_match_the_fake_quant_model(run, scheme, family, layout):
    tp, ep = layout
    name = f"{family}_{scheme}_tp{tp}ep{ep}"
    engine = _engine_model(run["base"] / "out" / name)
    with torch.no_grad():
        logits = engine(run["r0"]["tokens"]).logits.float()
    diff = _relative_max_diff(logits, run["r0"][name])
    print(f"{name}: engine-order logits vs Megatron fake quant, relative max difference {diff:.3g}")
    assert diff <= (FP8_TOLERANCE if scheme == "fp8" else NVFP4_TOLERANCE), diff


def test_down_proj_input_amax_is_calibrated_in_engine_order_at_top8_of_64(run):
    """Calibration gives the fc2 (down_proj) input quantizer of every expert the max of ``act``, the engines'
    down_proj input, not of ``prob * act``: at top-8 of 64 experts the probabilities are small, and the two differ by
    a large factor."""
    amax = run["r0"]["amax"]
    engine, megatron, calibrated = amax["engine"], amax["megatron"], amax["calibrated"]
    routed = [k for k in engine if engine[k] > 0]
    assert len(routed) > LAYERS * 32  # most experts saw tokens
    ratios = sorted(engine[k] / megatron[k] for k in routed)
    median = ratios[len(ratios) // 2]
    print(f"top-8 of 64: down_proj input amax, engine order / Megatron order: median {median:.3g}, "
          f"min {ratios[0]:.3g}, max {ratios[-1]:.3g} over {len(ratios)} experts")
    assert ratios[0] >= 1.0
    assert median > 2.0
    assert {k: calibrated[k] for k in routed} == {k: engine[k] for k in routed}
