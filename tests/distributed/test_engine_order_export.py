"""Trained as served: the exported checkpoint, run the way serving engines run it, gives the Megatron fake-quant
model's logits.

Serving engines (vLLM, SGLang, TensorRT-LLM, transformers) multiply the router probability into an expert's output
after ``down_proj``, whose input, ``act(gate_up(x))``, they quantize with the exported static input scale; Megatron's
expert MLPs multiply it in before ``linear_fc2``. The fake-quant forward must quantize that operand where the
engines do, or the exported down_proj input scale clips what the engines feed it.

One spawn (4 gloo ranks) builds tiny random Qwen3-MoE and Mixtral models (written by transformers; 3 layers, 8
experts, top-2) at TP1 x EP4 and TP2 x EP2, imports them into Megatron, quantizes them (FP8 W8A8 and NVFP4 W4A4, one
input amax per expert), exports compressed-tensors checkpoints and records the fake-quant logits, through the public
API as a training script does (on CPU, Megatron also needs the shims of ``megatron_cpu``); it also measures the
down_proj input amax in both orders at top-8 of 64 experts.

The engine emulation in the parent process uses no modelopt_moe code: transformers loads each exported checkpoint
(FP8 through ``CompressedTensorsConfig(dequantize=True)``; NVFP4 as the unquantized architecture with every quantized
weight decoded here from the exported codes and scales, since transformers 5.23 mis-scales NVFP4 experts), its fused
experts become per-expert ``nn.Linear`` modules running transformers' own expert loop (probability after
``down_proj``), and a forward pre-hook on every quantized linear quantizes the linear's input with the exported
static scale, the way the engines' kernels do.
"""

import glob
from pathlib import Path

import pytest
import torch
from limits import seconds  # noqa: E402
from torch import nn

from modelopt_moe.launch import spawn

WORLD, LAYERS, EXPERTS, TOPK, HIDDEN, INTER = 4, 3, 8, 2, 64, 32
LAYOUTS = ((1, 4), (2, 2))  # (TP, EP)
FAMILIES = ("qwen3_moe", "mixtral")
SCHEMES = {"fp8": "fp8_per_expert.yaml", "nvfp4": "nvfp4_default.yaml"}
WIDE = "qwen3_moe_top8of64"  # the amax-ratio measurement: top-8 of 64 experts
# (gate, up, down) module names of one expert in each family's checkpoint
EXPERT_NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
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
        cfg = mtq.load_config(SCHEMES[scheme])
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


def _tensors(path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for file in sorted(glob.glob(f"{path}/*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


class PerExpertLinears(nn.Module):
    """transformers' fused experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) as one module per expert
    holding ``nn.Linear`` s under the checkpoint's names (``experts.3.gate_proj``), with transformers' own expert
    loop: the router probability multiplies the expert's output after down_proj."""

    def __init__(self, fused: nn.Module, names: tuple[str, str, str]):
        super().__init__()
        self.names, self.num_experts, inter = names, fused.num_experts, fused.intermediate_dim
        self.__dict__["act_fn"] = fused.act_fn  # not a child: the children are the experts "0", "1", ...
        for e in range(fused.num_experts):
            expert = nn.Module()
            for name, w in zip(names, (fused.gate_up_proj[e, :inter], fused.gate_up_proj[e, inter:],
                                       fused.down_proj[e]), strict=True):
                linear = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
                linear.weight.data.copy_(w.detach())
                setattr(expert, name, linear)
            self.add_module(str(e), expert)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        gate, up, down = self.names
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            expert = getattr(self, str(e))
            token_idx, pos = torch.where(top_k_index == e)
            if token_idx.numel() == 0:
                continue
            x = hidden_states[token_idx]
            h = self.act_fn(getattr(expert, gate)(x)) * getattr(expert, up)(x)
            h = getattr(expert, down)(h) * top_k_weights[token_idx, pos, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        return out


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value of ``v >= 0``, ties to the even code, saturating at 6 (the engines' cvt.rn.satfinite)."""
    dist = (v.clamp(max=6.0).unsqueeze(-1) - _E2M1).abs() + 1e-9 * (torch.arange(8) % 2)  # ties: even code
    return _E2M1[dist.argmin(-1)]


def _fp8_static(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """A static-scale FP8 activation: ``x / input_scale`` saturated to E4M3, times the scale in the GEMM."""
    s = input_scale.float().reshape(())
    return (x.float() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float().mul(s).to(x.dtype)


def _nvfp4_static(x: torch.Tensor, input_global_scale: torch.Tensor) -> torch.Tensor:
    """An NVFP4 activation with the static global scale ``gs``: per 16 elements an E4M3 block scale
    ``e4m3(gs * blockmax / 6)``, values E2M1 of ``x / (block scale / gs)``, times that in the GEMM."""
    gs = input_global_scale.float().reshape(())
    blocks = x.float().reshape(*x.shape[:-1], -1, 16)
    bmax = blocks.abs().amax(-1, keepdim=True)
    sf = (gs * bmax / 6.0).clamp(max=448.0).to(torch.float8_e4m3fn).float()
    scale = sf / gs
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = _round_e2m1(blocks.abs() / safe) * blocks.sign()
    return torch.where(scale > 0, q * scale, torch.zeros_like(q)).reshape(x.shape).to(x.dtype)


def _decode_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' NVFP4 weight: two E2M1 codes per byte (even column in the low nibble; bit 3 the sign),
    times ``weight_scale / weight_global_scale`` per 16 columns."""
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1).long()
    values = _E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    scale = block_scale.float() / global_scale.float().reshape(())
    return values * scale.repeat_interleave(16, dim=1)


def _engine_model(path: Path, source: Path, scheme: str, family: str):
    """The ``transformers`` model of the exported checkpoint with static-scale input quantization of every quantized
    linear (per-expert linears for the experts)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    t = _tensors(path)
    if scheme == "fp8":
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.eval()
    for layer in model.model.layers:
        layer.mlp.experts = PerExpertLinears(layer.mlp.experts, EXPERT_NAMES[family])
    scale_key, quant = ("input_scale", _fp8_static) if scheme == "fp8" else ("input_global_scale", _nvfp4_static)
    linears = [k.removesuffix("." + scale_key) for k in t if k.endswith("." + scale_key)]
    assert len(linears) == LAYERS * (4 + 3 * EXPERTS)  # q, k, v, o and every expert's three
    with torch.no_grad():
        for name in linears:
            linear = model.get_submodule(name.replace(".block_sparse_moe.", ".mlp."))  # Mixtral's file names
            if scheme == "nvfp4":
                linear.weight.copy_(_decode_nvfp4(t[name + ".weight_packed"], t[name + ".weight_scale"],
                                                  t[name + ".weight_global_scale"]))
            scale = t[f"{name}.{scale_key}"]
            linear.register_forward_pre_hook(lambda module, args, s=scale: (quant(args[0], s),))
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
    results = spawn(_rank, WORLD, args=(paths,), timeout=seconds(900))
    return {"base": base, "paths": paths, "r0": results[0]}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda tp_ep: f"tp{tp_ep[0]}ep{tp_ep[1]}")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_engine_order_logits_match_the_fake_quant_model(run, scheme, family, layout):
    tp, ep = layout
    name = f"{family}_{scheme}_tp{tp}ep{ep}"
    engine = _engine_model(run["base"] / "out" / name, Path(run["paths"][family]), scheme, family)
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
