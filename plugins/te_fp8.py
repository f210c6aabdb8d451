"""``gemm: te_fp8``: the forward GEMMs of quantized Transformer Engine grouped linears as real FP8 GEMMs.

A ``te.GroupedLinear`` (and Megatron's ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``, which
subclass it) quantized to FP8 E4M3 with calibrated per-tensor amaxes (one per expert, or one shared) computes its
forward as a deployed FP8 model does:

* **Static scales, ours.** Expert ``i``'s weight and tokens are cast with ``s_i = 448 / amax_i`` (an invalid amax
  gives scale 1, as in :mod:`modelopt_moe.numerics.formats`) by TE's per-tensor ``Float8Quantizer``, which computes
  ``fp8(x * s_i)`` (saturating, nearest even): the codes of :func:`modelopt_moe.numerics.quantize`, bit for bit. No
  TE recipe is active, so neither delayed nor current scaling can change a scale; TE's cast records the max it sees
  in a scratch buffer, never in our amax.
* **TE's FP8 grouped GEMM** (``general_grouped_gemm``, cuBLASLt, split fp32 accumulation), output times
  ``(1 / s_x) * (1 / s_w)`` in the activation dtype, biases added in its epilogue.
* **The backward of the configured mode.** ``dequantized`` and ``high_precision``: the bf16 grouped GEMMs TE's own
  ``GroupedLinear`` backward calls, on the operands the fake-quant path gives them (``Q(x)``, ``Q(w)`` from the same
  fake-quant kernels and STE, or ``x``, ``w``): the gradients are the fake-quant path's, bit for bit;
  ``weight_amax_update`` static, dynamic and learned all work as there.
* **``quantized``: FP8 backward GEMMs.** The output gradient ``g`` is cast to ``grad_num_bits`` (E5M2 by default)
  with one scale from its own amax, the codes of ``fake_quant(g, fmt, max|g|)``; dgrad is the FP8 GEMM
  ``Q(g) Q(w)`` on the weights' transposed codes, and wgrad ``Q(g)^T Q(x)`` when every expert's token count is a
  multiple of 16 (cuBLAS reads the transposed codes of tokens and gradient; Megatron pads the counts so with
  ``moe_router_padding_for_quantization``), else the fake-quant path's bf16 wgrad on ``fake_quant(g)`` and ``Q(x)``.
  These gradients are the exact products of the FP8 operands (fp32 accumulation, bf16 output), as the forward, not
  the fake-quant path's bits. Given router probabilities (an expert down projection), dgrad is FP8 and wgrad the
  bf16 GEMM on ``scale_rows(Q(x), p)``. A layer with biases or a learned weight amax keeps the bf16 backward above
  (with ``g`` fake-quantized first).

* **Router probabilities.** As ``TEGroupedMLP``'s ``linear_fc2`` given the tokens' probabilities
  (:mod:`.megatron.router_probs`), the FP8 GEMM runs on ``Q(act)`` and its output rows are multiplied by them, the
  engines' order (one pass over the output); the backward operand is ``scale_rows(Q(act), prob)``, so the
  probabilities get their gradient as on the fake-quant path.

Amaxes, checkpoints and export are unchanged: only the forward GEMM differs from ``gemm: fake_quant``. While
``mtq.quantize`` calibrates, the fake-quant path runs (it collects the amaxes).

A config the FP8 GEMM cannot run is a ``ConfigError`` at ``mtq.quantize`` (end of calibration) and at every forward
(:func:`problems` lists them): a format other than E4M3, a per-channel or dynamic amax, an input or weight quantizer
disabled alone, an enabled output quantizer, autoswitch, an uncalibrated input amax, expert weights whose dims the
FP8 GEMM cannot align (``in_features % 16``, ``out_features % 8``), non-bf16/fp16 activations, and TE/Megatron
features this path does not implement (``delay_wgrad_compute``, Megatron's own TE quantization recipe, one grouped
bias tensor, FP8 primary weights, the ``out`` / ``dgrad_out`` buffers). A layer whose input and weight quantizers are
both disabled runs TE's bf16 forward. Every other quantized module (dense linears, ``SequentialMLP``, the
framework-free ``GroupedLinear``) runs fake quant as with ``gemm: fake_quant``: no warning, this is the documented
meaning.

Inside ``mtq.reuse_quantized_weights`` the FP8 weights, like the fake-quantized ones, are cast once per scope.

Weight gradients are returned as ``.grad`` of the expert weights; with Megatron's ``gradient_accumulation_fusion``
its DDP hook adds them to ``main_grad`` (correct, without the fusion's saving).

Transformer Engine is imported on first use, so :func:`problems` and :func:`engaged` also run without it.
"""

from __future__ import annotations

import functools
import sys
from types import SimpleNamespace

import torch
from torch.autograd.function import once_differentiable

from modelopt_moe.kernels import grouped_weight_amax
from modelopt_moe.numerics import ScaleLayout, get_format, safe_amax, scale_rows
from modelopt_moe.quantization.config import ConfigError
from modelopt_moe.quantization.nn.expert_weights import expert_weight_clip_mask, quantize_expert_weights
from modelopt_moe.quantization.nn.experts import expert_input_clip_mask, quantize_expert_inputs, split_sizes
from modelopt_moe.quantization.nn.functional import fake_quant_grad, mask_grad, quantize_grad
from modelopt_moe.quantization.nn.row_scale import row_scale_of, rows_of
from modelopt_moe.quantization.weight_reuse import reused_or_computed, weight_key

__all__ = ["GEMM", "engaged", "problems", "check", "forward", "fp8_scales", "quantize_inputs", "quantize_weights"]

GEMM = "te_fp8"  # the config's ``gemm`` value that selects this path
# Split (promoted fp32) accumulation in the FP8 forward GEMM: what an FP8 inference GEMM computes. TE's own fprop
# default is fast accumulation, which keeps fewer bits.
_SPLIT_ACCUMULATOR = True
# TE's GroupedLinear backward passes True for both (module/base.py); the same calls give the same bits.
_DGRAD_SPLIT_ACCUMULATOR = _WGRAD_SPLIT_ACCUMULATOR = True


@functools.cache
def _te() -> SimpleNamespace:
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.cpp_extensions import general_grouped_gemm
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    return SimpleNamespace(tex=tex, grouped_gemm=general_grouped_gemm, Float8Quantizer=Float8Quantizer,
                           dtypes={torch.float8_e4m3fn: tex.DType.kFloat8E4M3,
                                   torch.float8_e5m2: tex.DType.kFloat8E5M2})


# --- when it runs, what it refuses ----------------------------------------------------------------------------------
def engaged(module) -> bool:
    """Whether ``module``'s forward takes the te_fp8 path: gemm ``te_fp8``, a quantizer enabled, and no quantizer
    calibrating (calibration runs the fake-quant path, which collects the amaxes)."""
    iq, wq = module.input_quantizer, module.weight_quantizer
    if getattr(module, "quant_gemm", None) != GEMM or not (iq.is_enabled or wq.is_enabled):
        return False
    return not (iq.is_calibrating or wq.is_calibrating)


def problems(module) -> list[str]:
    """What keeps the FP8 GEMM from computing ``module``'s quantized forward (empty: it can)."""
    iq, wq = module.input_quantizer, module.weight_quantizer
    found = []
    for kind, q in (("input_quantizer", iq), ("weight_quantizer", wq)):
        if not q.is_quantizing:
            found.append(f"{kind} is not quantizing: te_fp8 runs FP8 x FP8 GEMMs, so both the input and the weight "
                         "quantizer must be enabled")
        elif get_format(q.fmt).element_dtype is not torch.float8_e4m3fn:
            found.append(f"{kind} format {q.fmt}: te_fp8 runs FP8 E4M3 GEMMs only")
        elif ScaleLayout.PER_TENSOR not in get_format(q.fmt).scale_layouts:
            found.append(f"{kind} format {q.fmt} scales each block of {get_format(q.fmt).block_length}: te_fp8 takes "
                         "one scale per expert (MXFP8 GEMMs need Blackwell; train it with gemm: fake_quant)")
        elif q.axis is not None:
            found.append(f"{kind} has a per-channel amax (axis={q.axis}): te_fp8 takes one scale per expert")
        elif q.block_size is not None or q.static_block_size is not None:
            found.append(f"{kind} quantizes in blocks ({q.block_size or q.static_block_size}): te_fp8 takes one "
                         "scale per expert")
        elif q.is_dynamic:
            found.append(f"{kind} takes its amax from each tensor (dynamic / per token): te_fp8 needs static scales")
    if iq.is_quantizing and iq.needs_amax and iq.amax is None:
        found.append("input_quantizer has no calibrated amax: run mtq.quantize with a forward_loop")
    if wq.is_quantizing and wq.amax is None and wq.amax_update != "dynamic":
        found.append("weight_quantizer has no amax: calibrate (mtq.quantize / mtq.calibrate)")
    k, n = getattr(module, "in_features", 16), getattr(module, "out_features", 8)
    if k % 16 or n % 8:  # cuBLAS FP8: 16-byte aligned rows of the FP8 operands and of the bf16 output
        found.append(f"expert weights [{n} x {k}]: the FP8 GEMM needs in_features % 16 == 0 and out_features % 8 == 0")
    if module.output_quantizer.is_enabled:
        found.append("output_quantizer is enabled: te_fp8 writes the GEMM output unquantized")
    if getattr(module, "quant_autoswitch", None) is not None:
        found.append("autoswitch is configured: te_fp8 has no per-expert high-precision fallback")
    wgrad_store = getattr(module, "wgrad_store", None)
    if wgrad_store is not None and wgrad_store.delay_wgrad_compute():
        found.append("delay_wgrad_compute=True: te_fp8 computes the weight gradients in the backward itself")
    if getattr(module, "te_quant_params", None) is not None:
        found.append("Megatron's TE quantization recipe (config.quant_recipe) is set for this layer")
    if getattr(module, "single_grouped_bias", False):
        found.append("single_grouped_bias=True: te_fp8 takes one bias tensor per expert")
    if getattr(module, "primary_weights_in_fp8", False):
        found.append("the weights are TE FP8 tensors (fp8_model_init): te_fp8 quantizes high-precision weights")
    return found


def check(module) -> None:
    """Raises ConfigError naming every :func:`problems` of ``module``."""
    found = problems(module)
    if found:
        raise ConfigError(f"{type(module).__name__}: gemm te_fp8 cannot run this layer (use gemm: fake_quant for "
                          "fake quant):\n  " + "\n  ".join(found))


@functools.cache
def _fp8_gemm_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


# --- FP8 operands ---------------------------------------------------------------------------------------------------
def fp8_scales(amax: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """``bound / amax`` per entry (448 for E4M3, 57344 for E5M2), the scale :func:`modelopt_moe.numerics.quantize`
    uses (IEEE division; an invalid amax entry gives scale 1)."""
    bound = get_format(fmt).bound
    a = safe_amax(amax.detach(), bound)
    return torch.div(torch.full_like(a, bound), a)


class _ExpertQuantizers:
    """N TE ``Float8Quantizer`` (one per expert) over one ``[N]`` scale buffer that each call rewrites in place: no
    host sync, and no quantizer objects built per call. Row-wise FP8 serves the TN forward GEMM; ``columnwise`` adds
    the transposed codes the backward's FP8 GEMMs read (dgrad reads the weights', wgrad the tokens' and gradient's)."""

    def __init__(self, n: int, device: torch.device, fmt: str, columnwise: bool):
        api = _te()
        self.fmt = fmt
        self.scale = torch.ones(n, dtype=torch.float32, device=device)
        self.seen_amax = torch.zeros(n, dtype=torch.float32, device=device)  # TE's casts write max|x| here
        self.quantizers = []
        te_dtype = api.dtypes[get_format(fmt).element_dtype]
        for i in range(n):
            q = api.Float8Quantizer(self.scale[i:i + 1], self.seen_amax[i:i + 1], te_dtype, rowwise=True,
                                    columnwise=columnwise)
            q.internal = True  # TE's storage class: less overhead than a torch tensor subclass
            self.quantizers.append(q)

    def with_scales_of(self, amax: torch.Tensor) -> list:
        """The quantizers, with scale ``bound / amax`` (``amax``: one entry per expert, or one for all)."""
        self.scale.copy_(fp8_scales(amax, self.fmt).expand_as(self.scale))
        return self.quantizers


def _expert_quantizers(module, kind: str, device: torch.device, fmt: str = "e4m3",
                       columnwise: bool = False) -> _ExpertQuantizers:
    """``module``'s TE quantizers of ``kind`` (``input`` / ``weight`` / ``grad``), kept in ``module.__dict__`` (a
    transient attribute: never pickled or deep-copied)."""
    cache = module.__dict__.setdefault("_te_fp8_quantizers", {})
    key = (kind, fmt, columnwise)
    entry = cache.get(key)
    if entry is None or entry.scale.device != device or entry.scale.numel() != module.num_gemms:
        entry = cache[key] = _ExpertQuantizers(module.num_gemms, device, fmt, columnwise)
    return entry


def quantize_inputs(module, x2d: torch.Tensor, splits: list[int], columnwise: bool = False) -> list:
    """The token matrix as N FP8 tensors (TE ``Float8TensorStorage``), expert ``i``'s rows with its input scale
    (``columnwise``: with the transposed codes too)."""
    q = _expert_quantizers(module, "input", x2d.device, columnwise=columnwise).with_scales_of(
        module.input_quantizer.amax)
    return _te().tex.split_quantize(x2d, splits, q)


def quantize_weights(module, weights: list[torch.Tensor], columnwise: bool = False) -> list:
    """The N expert weights as FP8 tensors with their scales (``columnwise``: with the transposed codes too); inside
    ``mtq.reuse_quantized_weights`` computed once while the weights, their versions and the amax are unchanged (cached
    under the weight quantizer: the layer's own entry holds its fake-quantized weights)."""
    wq = module.weight_quantizer

    def compute():
        q = _expert_quantizers(module, "weight", weights[0].device, columnwise=columnwise).with_scales_of(wq.amax)
        return _te().tex.multi_tensor_quantize(list(map(torch.Tensor.detach, weights)), q)

    device = weights[0].device
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return compute()
    tag = f"{GEMM}+transposed" if columnwise else GEMM
    return reused_or_computed(wq, lambda: weight_key(weights, wq.amax, tag), compute)


def fp8_backward(module) -> bool:
    """Whether the backward GEMMs run in FP8 too: ``backward.mode: quantized`` asks for the output gradient
    fake-quantized per tensor, so dgrad (``Q(g) Q(w)``) and wgrad (``Q(g)^T Q(x)``) are products of FP8 operands.
    Not with biases (their gradient would need the dequantized gradient), a learned weight amax (its gradient comes
    through the fake-quant operands), or an ``out_features`` that is not a multiple of 16 (dgrad's FP8 operands need
    16-byte aligned rows); those keep the bf16 backward on the fake-quant operands."""
    return (module.quant_backward.mode == "quantized" and not module.apply_bias
            and module.weight_quantizer.amax_update != "learned" and module.out_features % 16 == 0)


def _fp8_grouped_gemm(x_fp8, w_fp8, splits, out_features, dtype, device, biases):
    out = torch.empty(sum(splits), out_features, dtype=dtype, device=device)
    _te().grouped_gemm(w_fp8, x_fp8, [out], [None] * len(w_fp8), dtype, layout="TN", m_splits=splits,
                       bias=biases or None, use_bias=bool(biases), use_split_accumulator=_SPLIT_ACCUMULATOR,
                       single_output=True)
    return out


class _Fp8ForwardGemm(torch.autograd.Function):
    """``apply(x_fp8, w_fp8, splits, dtype, row_scale, x_b, *w_b, *biases)``: the output of the FP8 grouped GEMM on
    ``x_fp8`` / ``w_fp8`` (plus ``biases``), its rows times ``row_scale`` if given (an expert down projection's router
    probabilities, applied to the output as the engines do; ``x_b`` then carries them too); the gradient of ``x_b @
    w_b^T + b``, by the calls TE's GroupedLinear backward makes: dgrad ``g @ w_b`` (layout NN), wgrad ``g^T @ x_b``
    with the bias gradient in its epilogue (NT)."""

    @staticmethod
    def forward(ctx, x_fp8, w_fp8, splits, dtype, row_scale, x_b, *operands):
        n = len(w_fp8)
        w_b, biases = operands[:n], [b.to(dtype) for b in operands[n:]]
        out = _fp8_grouped_gemm(x_fp8, w_fp8, splits, w_b[0].shape[0], dtype, x_b.device, biases)
        if row_scale is not None:
            out = scale_rows(out, row_scale)
        ctx.save_for_backward(x_b, *w_b, *biases)
        ctx.n, ctx.splits, ctx.dtype = n, splits, dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        n, splits, dtype = ctx.n, ctx.splits, ctx.dtype
        x_b, *rest = ctx.saved_tensors
        w_b, biases = rest[:n], rest[n:]
        grad = grad.contiguous().view(-1, grad.shape[-1]).to(dtype)
        grads = torch.split(grad, splits)
        gemm = _te().grouped_gemm
        dgrad = None
        if ctx.needs_input_grad[5]:
            dgrad = torch.empty(grad.shape[0], x_b.shape[-1], dtype=dtype, device=grad.device)
            gemm([w.to(dtype) for w in w_b], grads, [dgrad], [None] * n, dtype, single_output=True, layout="NN",
                 m_splits=splits, grad=True, use_split_accumulator=_DGRAD_SPLIT_ACCUMULATOR)
        wgrads, bgrads = [None] * n, [None] * len(biases)
        if any(ctx.needs_input_grad[6:]):
            packed = torch.empty(n, *w_b[0].shape, dtype=dtype, device=grad.device)
            wgrads = [packed[i] for i in range(n)]
            _, bias_grads, _ = gemm(list(torch.split(x_b.to(dtype), splits)), grads, wgrads, [None] * n, dtype,
                                    layout="NT", grad=True, m_splits=splits, use_bias=bool(biases),
                                    bias=list(biases) or None, use_split_accumulator=_WGRAD_SPLIT_ACCUMULATOR,
                                    accumulate=False)
            if biases:
                bgrads = list(bias_grads)
        return (None, None, None, None, None, dgrad, *wgrads, *bgrads)


def fp8_wgrad(splits: list[int]) -> bool:
    """Whether wgrad can be an FP8 GEMM for these token counts: it reads the transposed codes of each expert's tokens
    and gradient, whose rows (one per token) cuBLAS needs 16-byte aligned: every count a multiple of 16 (Megatron's
    ``moe_router_padding_for_quantization`` pads them so)."""
    return all(s % 16 == 0 for s in splits)


class _Fp8Gemm(torch.autograd.Function):
    """``apply(x_fp8, w_fp8, splits, dtype, grad_fmt, module, wgrad_fp8, row_scale, x_b, *w)``: the FP8 grouped GEMM
    of ``x_fp8`` / ``w_fp8`` (its output rows times ``row_scale`` if given: an expert down projection's router
    probabilities, applied as the engines do), whose backward runs as ``backward.mode: quantized`` describes it, on FP8
    GEMMs.

    The output gradient ``g`` is cast to ``grad_fmt`` with one scale from its own amax (``fake_quant(g, grad_fmt,
    max|g|)``'s codes). dgrad is ``Q(g) @ Q(w)`` (layout NN, the weights' transposed codes). With ``wgrad_fp8``
    (``x_fp8`` then has transposed codes too) wgrad is ``Q(g)^T @ Q(x)`` (NT); otherwise (token counts
    :func:`fp8_wgrad` refuses, or router probabilities) it is the fake-quant path's bf16 GEMM ``fake_quant(g)^T @ x_b``
    with ``x_b = Q(x)`` (``scale_rows(Q(x), p)``).
    Both FP8 GEMMs accumulate in fp32 (split). ``x_b`` and ``w`` are the operands the gradients go to (straight
    through the quantizers, masked by a clipped STE outside); the weights' values are not kept."""

    @staticmethod
    def forward(ctx, x_fp8, w_fp8, splits, dtype, grad_fmt, module, wgrad_fp8, row_scale, x_b, *w):
        ctx.fp8_wgrad = wgrad_fp8
        ctx.w_fp8, ctx.splits, ctx.dtype, ctx.in_features = w_fp8, splits, dtype, x_b.shape[-1]
        ctx.grad_quantizers = _expert_quantizers(module, "grad", x_b.device, grad_fmt,
                                                 columnwise=wgrad_fp8 and any(ctx.needs_input_grad[9:]))
        if wgrad_fp8:  # the tokens' FP8 codes serve wgrad
            ctx.x_fp8 = x_fp8
        else:  # the bf16 wgrad's operand instead: the codes are not kept
            ctx.x_fp8 = None
            ctx.save_for_backward(x_b)
        out = _fp8_grouped_gemm(x_fp8, w_fp8, splits, w[0].shape[0], dtype, x_b.device, [])
        return out if row_scale is None else scale_rows(out, row_scale)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        n, splits, dtype = len(ctx.w_fp8), ctx.splits, ctx.dtype
        grad = grad.contiguous().view(-1, grad.shape[-1]).to(dtype)
        need_dgrad, need_wgrad = ctx.needs_input_grad[8], any(ctx.needs_input_grad[9:])
        amax = grouped_weight_amax([grad])
        g_fp8 = _te().tex.split_quantize(grad, splits, ctx.grad_quantizers.with_scales_of(amax))
        gemm = _te().grouped_gemm
        dgrad = None
        if need_dgrad:
            dgrad = torch.empty(grad.shape[0], ctx.in_features, dtype=dtype, device=grad.device)
            gemm(ctx.w_fp8, g_fp8, [dgrad], [None] * n, dtype, single_output=True, layout="NN", m_splits=splits,
                 grad=True, use_split_accumulator=_DGRAD_SPLIT_ACCUMULATOR)
        wgrads = [None] * n
        if need_wgrad:
            packed = torch.empty(n, grad.shape[-1], ctx.in_features, dtype=dtype, device=grad.device)
            wgrads = [packed[i] for i in range(n)]
            if ctx.fp8_wgrad:
                a, b = ctx.x_fp8, g_fp8
            else:
                (x_b,) = ctx.saved_tensors
                a = list(torch.split(x_b.to(dtype), splits))
                b = list(torch.split(fake_quant_grad(grad, ctx.grad_quantizers.fmt, amax=amax), splits))
            gemm(a, b, wgrads, [None] * n, dtype, layout="NT", grad=True, m_splits=splits,
                 use_split_accumulator=_WGRAD_SPLIT_ACCUMULATOR, accumulate=False)
        ctx.x_fp8 = ctx.w_fp8 = None
        return (None, None, None, None, None, None, None, None, dgrad, *wgrads)


# --- the layer's forward ----------------------------------------------------------------------------------------------
@functools.cache
def _return_convention(cls: type) -> str:
    """``te``: what ``te.GroupedLinear.forward`` returns; ``megatron``: what Megatron's ``TEGroupedLinear.forward``
    returns. The FP8 path replaces TE's forward, so it returns what the host class's forward would."""
    import transformer_engine.pytorch as te

    owner = next(c for c in cls.__mro__ if "forward" in vars(c))
    if owner is te.GroupedLinear:
        return "te"
    mcore = sys.modules.get("megatron.core.extensions.transformer_engine")
    if mcore is not None and owner is getattr(mcore, "TEGroupedLinear", None):
        return "megatron"
    raise NotImplementedError(f"gemm te_fp8: {cls.__name__}.forward is {owner.__qualname__}'s; te_fp8 returns what "
                              "te.GroupedLinear.forward or Megatron's TEGroupedLinear.forward returns and knows no "
                              "other forward (use gemm: fake_quant)")


def _activation_dtype(x: torch.Tensor) -> torch.dtype:
    """TE's rule: the autocast dtype when autocast is on, else the input's."""
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype


def forward(module, x: torch.Tensor, m_splits, **host_args):
    """``module``'s forward (a quantized TE grouped linear) with the FP8 forward GEMM; returns what the host class's
    forward returns. ``host_args``: the host forward's other arguments (``is_first_microbatch`` is accepted and has
    nothing to do here: no TE FP8 weight cache is involved)."""
    convention = _return_convention(module._original_cls)
    unsupported = sorted(k for k, v in host_args.items() if v is not None and k != "is_first_microbatch")
    if unsupported:
        raise NotImplementedError(f"{type(module).__name__}: gemm te_fp8 does not take forward arguments "
                                  f"{unsupported} (use gemm: fake_quant)")
    check(module)
    dtype = _activation_dtype(x)
    if dtype not in (torch.bfloat16, torch.float16):
        raise ConfigError(f"{type(module).__name__}: gemm te_fp8 needs bf16 or fp16 activations, got {dtype}")
    if x.device.type != "cuda" or not _fp8_gemm_capable(x.device.index or 0):
        raise RuntimeError(f"{type(module).__name__}: gemm te_fp8 needs a GPU with FP8 tensor cores (compute "
                           f"capability 8.9 or newer), got {x.device}")
    iq, wq = module.input_quantizer, module.weight_quantizer
    splits = split_sizes(m_splits)
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    if len(splits) != module.num_gemms or sum(splits) != x2d.shape[0]:
        raise ValueError(f"{type(module).__name__}: m_splits {splits} must have {module.num_gemms} entries summing "
                         f"to the {x2d.shape[0]} input rows")
    weights = list(module.expert_weights())
    # As an expert down projection given the router probabilities (plugins/megatron/router_probs.py): the FP8 GEMM
    # runs on Q(x) and its output rows are multiplied by them, the engines' order.
    scale = row_scale_of(module)
    if scale is not None:
        scale = rows_of(scale, x2d, type(module).__name__)
        if module.apply_bias:
            raise NotImplementedError(f"{type(module).__name__}: gemm te_fp8 adds the bias in the GEMM, where the "
                                      "router probabilities would not scale it (return the bias instead)")
    with_grad = torch.is_grad_enabled()
    fp8_bwd = with_grad and fp8_backward(module)
    wgrad_fp8 = fp8_bwd and scale is None and fp8_wgrad(splits)
    # The fake-quantized weights are the bf16 backward's operands; computing them also refreshes a dynamic amax,
    # which the FP8 scales then take (without them only that refresh is needed).
    w_q = None
    if with_grad and not fp8_bwd:
        w_q = quantize_expert_weights(wq, weights, "auto", owner=module)
    elif wq.amax_update == "dynamic":  # only the refresh (cached per step in a reuse scope like the values)
        with torch.no_grad():
            quantize_expert_weights(wq, weights, "auto", owner=module)
    x_fp8 = quantize_inputs(module, x2d, splits, columnwise=wgrad_fp8)
    w_fp8 = quantize_weights(module, weights, columnwise=fp8_bwd)
    biases = module._get_bias_tensors() if module.apply_bias else []
    if fp8_bwd:
        weight_mask = expert_weight_clip_mask(wq, weights)
        if wgrad_fp8:  # the gradient to x goes straight through Q (masked by a clipped STE)
            x_b = mask_grad(x2d, expert_input_clip_mask(iq, x2d, splits))
        else:  # bf16 wgrad on Q(x) (times the probabilities); its autograd passes dgrad on to x (and them)
            x_b = quantize_expert_inputs(iq, x2d, splits, "auto", module._splits_cache(), row_scale=scale)
        out = _Fp8Gemm.apply(x_fp8, w_fp8, splits, dtype, module.quant_backward.grad_format, module, wgrad_fp8,
                             None if scale is None else scale.detach(), x_b,
                             *(mask_grad(w, weight_mask(w)) for w in weights))
    elif with_grad:
        if module.quant_backward.mode == "high_precision":
            x_b = mask_grad(x2d, expert_input_clip_mask(iq, x2d, splits))
            x_b = x_b if scale is None else scale_rows(x_b, scale)
            weight_mask = expert_weight_clip_mask(wq, weights)
            w_b = [mask_grad(w, weight_mask(w)) for w in weights]
        else:
            x_b = quantize_expert_inputs(iq, x2d, splits, "auto", module._splits_cache(), row_scale=scale)
            w_b = w_q
        out = _Fp8ForwardGemm.apply(x_fp8, w_fp8, splits, dtype, None if scale is None else scale.detach(), x_b,
                                    *w_b, *biases)
        if module.quant_backward.mode == "quantized":
            out = quantize_grad(out, module.quant_backward.grad_format, module.quant_kernel)
    else:
        out = _fp8_grouped_gemm(x_fp8, w_fp8, splits, weights[0].shape[0], dtype, x.device,
                                [b.to(dtype) for b in biases])
        out = out if scale is None else scale_rows(out, scale)
    out = out.view(-1, *x.shape[1:-1], out.shape[-1])
    result = (out, [b.to(dtype) for b in module._get_bias_tensors()]) if module.return_bias else out
    if convention == "megatron":
        module.is_first_microbatch = False  # as Megatron's forward leaves it
        return result if module.te_return_bias else (result, None)
    return result
