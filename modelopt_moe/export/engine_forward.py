"""An engine-order reference forward of an exported checkpoint, from its files alone, on the CPU.

Serving engines (vLLM, SGLang, TensorRT-LLM) run a quantized linear as: weight decoded from the stored codes and
scales, input quantized with the stored static input scale (FP8: ``x / input_scale`` saturated to E4M3; NVFP4: per
16 values an E4M3 block scale ``e4m3(gs * blockmax / 6)`` from the static global scale ``gs``, values rounded to
E2M1), and the router probability multiplied into an expert's output after ``down_proj``. This module builds that
model in fp32: ``transformers`` supplies the architecture (attention, RoPE, norms, router; built from the config,
its weights loaded from the files), every quantized linear's weight is decoded here, the fused experts become one
``nn.Linear`` per expert and projection running transformers' own expert loop, and a forward pre-hook quantizes
each quantized linear's input.

A checkpoint with a quantized KV cache (``kv_cache_scheme`` / ``kv_cache_quant_algo: FP8``) runs its attention on K and
V as the engines store them: after RoPE, each layer's K and V become the FP8 codes ``fp8(k / k_scale)`` (saturated to
+-448, round to nearest even: vLLM's cache writer ``__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, E4M3)``) and
attention reads them back as ``codes * k_scale``. The query stays in high precision. An NVFP4 KV cache is refused:
the engine-side NVFP4 cache is not emulated here (docs/export.md, "The KV cache").

Inputs that the checkpoint's ``nvfp4_four_over_six`` marker lists (:mod:`.four_over_six`) are quantized with the
4-over-6 rule (:func:`nvfp4_four_over_six_static_input`: FlashInfer's ``nvfp4_4over6``, which the marker asks the
engine to run), the others with plain NVFP4.

Which input scale each linear uses: ``engine=None`` its own stored scale; an engine name, the one that engine uses
after collapsing an MoE layer's per-expert scales (:data:`.check_rules.ENGINE_RULES`: the largest over the layer's
experts, or over each expert's gate and up). Gate and up are assumed to share their weight scales (the checker
reports where they do not).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from ..numerics.fp8 import E4M3
from ..numerics.nvfp4 import E2M1_MAX, block_square_error
from .check_rules import ENGINE_RULES, FORMAT_RULES
from .checkpoint_layout import checkpoint_layout
from .codecs import E2M1_VALUES, decode_fp8_file, decode_nvfp4_ct, decode_nvfp4_modelopt
from .errors import ExportError
from .kv_cache import read_kv_cache_scales

__all__ = ["engine_order_model", "engine_order_kl", "fp8_static_input", "nvfp4_static_input",
           "nvfp4_four_over_six_static_input"]


def fp8_static_input(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """A static-scale FP8 activation: ``x / input_scale`` saturated to E4M3, times the scale in the GEMM."""
    s = input_scale.float().reshape(())
    return (x.float() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float().mul(s).to(x.dtype)


def _round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value of ``v >= 0``, ties to the even code, saturating at 6 (the engines' cvt.rn.satfinite)."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=v.device)
    dist = (v.clamp(max=6.0).unsqueeze(-1) - grid).abs() + 1e-9 * (torch.arange(8, device=v.device) % 2)
    return grid[dist.argmin(-1)]


def nvfp4_static_input(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """An NVFP4 activation with the static global scale ``gs`` (the reciprocal convention, ``2688 / amax``): per 16
    elements an E4M3 block scale ``e4m3(gs * blockmax / 6)``, values E2M1 of ``x / (block scale / gs)``, times that
    in the GEMM."""
    gs = global_scale.float().reshape(())
    blocks = x.float().reshape(*x.shape[:-1], -1, 16)
    return _engine_nvfp4_blocks(blocks, gs, E2M1_MAX).reshape(x.shape).to(x.dtype)


def _engine_nvfp4_blocks(blocks: torch.Tensor, gs: torch.Tensor, divisor: float) -> torch.Tensor:
    """``blocks`` ``[..., K/16, 16]`` as an engine dequantizes them under the global scale ``gs`` and the block scales
    ``e4m3(gs * blockmax / divisor)`` (6; 4-over-6 also tries 4): E2M1 values times ``block scale / gs``, zero where
    that is 0."""
    bmax = blocks.abs().amax(-1, keepdim=True)
    sf = (gs * bmax / divisor).clamp(max=448.0).to(torch.float8_e4m3fn).float()
    scale = sf / gs
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = _round_e2m1(blocks.abs() / safe) * blocks.sign()
    return torch.where(scale > 0, q * scale, torch.zeros_like(q))


def nvfp4_four_over_six_static_input(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """An NVFP4 activation with 4-over-6 block scales under the static global scale ``gs`` (the reciprocal convention,
    ``1536 / amax``; FlashInfer's ``nvfp4_4over6`` with block scales normalized to 256): per 16 elements the block is
    rounded under ``e4m3(gs * blockmax / 6)`` and under ``e4m3(gs * blockmax / 4)``, and keeps the one of smaller
    squared error (summed as training sums it; the 6 where equal)."""
    gs = global_scale.float().reshape(())
    blocks = x.float().reshape(*x.shape[:-1], -1, 16)
    q6, q4 = (_engine_nvfp4_blocks(blocks, gs, d) for d in (E2M1_MAX, 4.0))
    four = block_square_error(q4 - blocks) < block_square_error(q6 - blocks)
    return torch.where(four, q4, q6).reshape(x.shape).to(x.dtype)


# The engine-side input quantizers of 4-over-6 inputs, by the format's NVFP4 one (the checkpoint's marker says which).
_FOUR_OVER_SIX_INPUTS = {
    "compressed-tensors": nvfp4_four_over_six_static_input,
    "modelopt": lambda x, s: nvfp4_four_over_six_static_input(x, 1.0 / s.float()),
}


# (format, rule key) -> (decoder of (weight tensor, block/tensor scale, second scale), input quantizer taking the
# stored input scale, whether the stored NVFP4 input scale is the reciprocal of the global scale)
_DECODE = {
    ("compressed-tensors", "fp8_tensor"): (lambda t, m: decode_fp8_file(t[m + ".weight"], t[m + ".weight_scale"],
                                                                 torch.float32), fp8_static_input),
    ("compressed-tensors", "fp8_channel"): (lambda t, m: decode_fp8_file(t[m + ".weight"], t[m + ".weight_scale"],
                                                                         torch.float32), fp8_static_input),
    ("modelopt", "fp8_tensor"): (lambda t, m: decode_fp8_file(t[m + ".weight"], t[m + ".weight_scale"], torch.float32),
                          fp8_static_input),
    ("compressed-tensors", "nvfp4_blocks"): (
        lambda t, m: decode_nvfp4_ct(t[m + ".weight_packed"], t[m + ".weight_scale"], t[m + ".weight_global_scale"],
                                     torch.float32), nvfp4_static_input),
    ("modelopt", "nvfp4_blocks"): (
        lambda t, m: decode_nvfp4_modelopt(t[m + ".weight"], t[m + ".weight_scale"], t[m + ".weight_scale_2"],
                                           torch.float32),
        lambda x, s: nvfp4_static_input(x, 1.0 / s.float())),  # vLLM: a1_gscale = 1 / input_scale
}


class _PerExpertLinears(nn.Module):
    """An MoE layer's experts as one module per expert (``"3"``) holding ``nn.Linear`` s under the checkpoint's
    names, with transformers' expert-loop signature: the router probability multiplies after down_proj."""

    def __init__(self, weights: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], names, act_fn):
        super().__init__()
        self.names = names
        self.__dict__["act_fn"] = act_fn  # not a child: the children are the experts
        for e, ws in enumerate(weights):
            expert = nn.Module()
            for name, w in zip(names, ws, strict=True):
                linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
                linear.weight.data.copy_(w)
                setattr(expert, name, linear)
            self.add_module(str(e), expert)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        gate, up, down = self.names
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self.children()):
            token_idx, pos = torch.where(top_k_index == e)
            if token_idx.numel() == 0:
                continue
            x = hidden_states[token_idx]
            h = self.act_fn(getattr(expert, gate)(x)) * getattr(expert, up)(x)
            h = getattr(expert, down)(h) * top_k_weights[token_idx, pos, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        return out


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not a dict)
    return out


def _input_scales(layout, tensors: dict, engine: str | None) -> dict[str, torch.Tensor]:
    """Module -> the stored-convention input scale it runs with (its own, or the engine's after the collapse)."""
    out = {}
    for module, scheme in layout.schemes.items():
        if scheme.inputs:
            rule = FORMAT_RULES[(layout.format, scheme.key)].role("input_scale")
            out[module] = tensors[f"{module}.{rule.suffix}"]
    if engine is None:
        return out
    fam, arch = layout.family, layout.arch

    def largest(modules):  # the stored value that stands for the largest amax (4-over-6 bounds included)
        return out[max(modules, key=lambda m: layout.format_rule(m).role("input_scale").amax(out[m].float().item()))]

    for layer in range(arch.num_layers):
        names = {k: [fam.hf_module(f"layers.{layer}.experts.{e}.{k}") for e in range(arch.num_experts)]
                 for k in ("gate", "up", "down")}
        scheme = layout.schemes.get(names["gate"][0])
        engine_rule = ENGINE_RULES.get((engine, layout.format, scheme[0])) if scheme else None
        if engine_rule is None or not scheme[1]:
            continue
        for group in (names["gate"] + names["up"], names["down"]):
            if engine_rule.input_collapse == "layer":
                chosen = largest(group)
                out.update({m: chosen for m in group})
        if engine_rule.input_collapse == "expert":
            for g, u in zip(names["gate"], names["up"], strict=True):
                out[g] = out[u] = largest([g, u])
    return out


def _in_memory(family, name: str) -> str:
    """The in-memory module path (transformers') of a file name (Mixtral's ``block_sparse_moe`` is ``mlp`` there)."""
    block = family.hf_module("layers.0.experts.0.gate").split(".layers.0.", 1)[1].split(".")[0]
    return name.replace(f".{block}.", ".mlp.")


def _expert_linear_names(family) -> tuple[str, str, str]:
    """The expert's gate, up and down linears' own names in the files (``gate_proj`` / Mixtral's ``w1``, ...)."""
    return tuple(family.hf_module(f"layers.0.experts.0.{k}").rsplit(".", 1)[1] for k in ("gate", "up", "down"))


def _kv_cache_scales(path: Path, layout, qcfg: dict | None, tensors: dict
                     ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Every layer's ``(k_scale, v_scale)`` of an FP8 KV cache (None: the KV cache is not quantized), from
    ``config.json``'s ``quantization_config`` ``qcfg``, or ``hf_quant_config.json`` where it has none."""
    if qcfg is None:  # Model Optimizer's hf_quant_config.json alone
        qcfg = json.loads((path / "hf_quant_config.json").read_text()).get("quantization") or {}
    fam = layout.family
    kv_modules = [(fam.hf_module(f"layers.{L}.k_proj"), fam.hf_module(f"layers.{L}.v_proj"))
                  for L in range(layout.arch.num_layers)]
    read = read_kv_cache_scales(qcfg, layout.format, tensors, kv_modules)
    if read is None:
        return None
    fmt, scales = read
    if fmt is not E4M3:
        raise ExportError(f"{path}: a KV cache in {fmt.label}: the engine-order forward emulates an FP8 KV cache only")
    return scales


_KV_ATTENTION = "modelopt_moe_fp8_kv_cache_{}"


def _use_fp8_kv_cache(model: nn.Module, scales: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every attention layer of ``model`` computes on K and V stored in FP8 with its layer's scales (the model's own
    attention implementation on the dequantized codes)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = model.config._attn_implementation
    name = _KV_ATTENTION.format(base)
    if name not in ALL_ATTENTION_FUNCTIONS:
        def attention(module, query, key, value, attention_mask, **kwargs):
            inner = ALL_ATTENTION_FUNCTIONS.get_interface(base, sdpa_attention_forward)
            key, value = fp8_static_input(key, module.k_scale), fp8_static_input(value, module.v_scale)
            return inner(module, query, key, value, attention_mask, **kwargs)

        AttentionInterface.register(name, attention)
    for layer, (k_scale, v_scale) in zip(model.model.layers, scales, strict=True):
        # where the engines' attention layers hold them (vLLM's Attention.k_scale / v_scale)
        layer.self_attn.register_buffer("k_scale", k_scale.clone())
        layer.self_attn.register_buffer("v_scale", v_scale.clone())
    model.set_attn_implementation(name)


def engine_order_model(path: str | os.PathLike, engine: str | None = None, kv_cache: bool = True) -> nn.Module:
    """The ``transformers`` model of the checkpoint at ``path`` run in engine order (see the module docstring), in
    fp32, in eval mode.

    Args:
        path: a compressed-tensors or Model Optimizer checkpoint of a known family (FP8 or NVFP4 linears).
        engine: None: every linear quantizes its input with its own stored scale; ``vllm`` / ``sglang`` /
            ``trtllm``: with the scale that engine uses after collapsing the experts' input scales.
        kv_cache: False runs attention on K and V in high precision even where the checkpoint quantizes its KV cache
            (to see what the KV cache's quantization costs).

    Raises:
        ExportError: a checkpoint the checker's rules do not cover, whose 4-over-6 marker is malformed, or whose
            tensors do not fit the model; with ``kv_cache``, a KV-cache scheme other than FP8, or a missing or invalid
            ``k_scale`` / ``v_scale``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    findings = []
    layout = checkpoint_layout(path, findings)
    if layout is None:
        raise ExportError(f"{path}: not a quantized checkpoint the checker knows (run check_checkpoint for why)")
    bad_config = next((f for f in findings if f.severity == "error" and f.rule == "config"), None)
    if bad_config is not None:  # a malformed 4-over-6 marker: which inputs to round with 4-over-6 is unknown
        raise ExportError(f"{path}: {bad_config.where}: {bad_config.message}")
    undecoded = sorted({s.key for s in layout.schemes.values() if (layout.format, s.key) not in _DECODE})
    if undecoded:
        known = sorted(k for f, k in _DECODE if f == layout.format)
        raise ExportError(f"{path}: the engine-order forward decodes {known} linears of {layout.format} checkpoints, "
                          f"not {undecoded}")
    cfg = json.loads((path / "config.json").read_text())
    qcfg = cfg.pop("quantization_config", None)
    config = AutoConfig.for_model(**cfg)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = _tensors(path)
    scales = _input_scales(layout, tensors, engine)
    kv_scales = _kv_cache_scales(path, layout, qcfg, tensors) if kv_cache else None
    weights = {}
    for module in layout.shapes:
        scheme = layout.schemes.get(module)
        if scheme is None:
            weights[module] = tensors[module + ".weight"].float()
        else:
            weights[module] = _DECODE[(layout.format, scheme[0])][0](tensors, module)
    fam, arch = layout.family, layout.arch
    state = {}
    experts = set()
    for layer in range(arch.num_layers):
        for e in range(arch.num_experts):
            experts.update(fam.hf_module(f"layers.{layer}.experts.{e}.{k}") for k in ("gate", "up", "down"))
    for name, t in tensors.items():
        module = name.rsplit(".", 1)[0]
        if module in experts or (module in layout.schemes):
            continue
        if name.endswith(".weight") and t.is_floating_point():  # not the KV cache's k_scale / v_scale
            state[_in_memory(fam, name)] = t.float()
    state.update({_in_memory(fam, m) + ".weight": w for m, w in weights.items() if m not in experts})
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if ".experts." not in k]
    if missing or unexpected:
        raise ExportError(f"{path}: the files do not fit {config.architectures}: missing {missing[:4]}, unexpected "
                          f"{unexpected[:4]}")
    names = _expert_linear_names(fam)
    for layer, block in enumerate(model.model.layers):
        per_expert = [tuple(weights[fam.hf_module(f"layers.{layer}.experts.{e}.{k}")] for k in ("gate", "up", "down"))
                      for e in range(arch.num_experts)]
        block.mlp.experts = _PerExpertLinears(per_expert, names, block.mlp.experts.act_fn)
    for module, scale in scales.items():
        quant = _FOUR_OVER_SIX_INPUTS[layout.format] if module in layout.four_over_six_inputs else \
            _DECODE[(layout.format, layout.schemes[module][0])][1]
        linear = model.get_submodule(_in_memory(fam, module))
        linear.register_forward_pre_hook(lambda mod, args, s=scale, q=quant: (q(args[0], s),))
    if kv_scales is not None:
        _use_fp8_kv_cache(model, kv_scales)
    return model


def engine_order_kl(path: str | os.PathLike, reference, engine: str | None = None, kv_cache: bool = True
                    ) -> list[float]:
    """Per batch of ``reference`` (``[(tokens [B, S], logits [B, S, V]), ...]``), the mean over tokens of
    KL(softmax(reference logits) || softmax(engine-order logits)) of the checkpoint at ``path``
    (:func:`engine_order_model`'s ``engine`` and ``kv_cache``)."""
    model = engine_order_model(path, engine, kv_cache)
    out = []
    with torch.no_grad():
        for tokens, logits in reference:
            mine = model(tokens).logits.double().log_softmax(-1)  # in float64: no negative KL from rounding
            ref = logits.double().log_softmax(-1)
            out.append((ref.exp() * (ref - mine)).sum(-1).mean().item())
    return out
