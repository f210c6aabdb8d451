"""Benchmark: a whole Megatron-Core MoE training step (forward, backward, optimizer), bf16 vs fake-quantized QAT.

The model is a Qwen3-MoE-like Megatron ``GPTModel`` with Transformer Engine's layer spec
(``get_gpt_layer_with_transformer_engine_spec(num_experts, moe_grouped_gemm=True)``: TE attention, RMSNorm, QK norm,
``TEGroupedMLP`` experts), every layer MoE, SwiGLU experts, no load-balancing loss, bf16 parameters trained the
usual Megatron way (``modelopt_moe.plugins.megatron.training.setup_training``: ``Float16Module``, Megatron
DDP with fp32 gradients, ``get_megatron_optimizer`` Adam with fp32 main parameters and the distributed optimizer).
Defaults: 2 layers, hidden 2048, 128 experts of FFN 768, top-8, 16 attention heads (4 KV groups), seq 4096,
micro-batch 1, vocab 32000, the alltoall token dispatcher; one GPU (world size 1, NCCL).

Variants, each its own model instance built from the same seed:
  bf16              no quantization
  fp8, nvfp4        ``mtq.quantize(model, mtq.load_config("fp8_default.yaml" / "nvfp4_default.yaml"), loop)``,
                    calibrated on random-token batches. With the TE spec the presets quantize the experts (TE's
                    dense attention linears are not converted; the router and output layer stay bf16)
  nvfp4_4over6      NVFP4 with 4-over-6 block scales from the data (``nvfp4_4over6.yaml``): each block quantized
                    twice, the closer kept
  fp8-te_fp8        fp8 with ``gemm: te_fp8``: the experts' forward GEMMs as real FP8 GEMMs in Transformer Engine
                    (without TE, on CPU, the same as fp8)
  modelopt-fp8,     NVIDIA Model Optimizer's ``mto.quantize(model, mto.FP8_DEFAULT_CFG / NVFP4_DEFAULT_CFG, loop)``,
  modelopt-nvfp4    only when ``modelopt`` imports (otherwise one line says why they were skipped); its presets
                    also quantize the TE attention linears, so the quantized-weight counts printed differ

Every variant runs two step modes, each a real optimizer step (zero the gradients, ``forward_backward_func`` over the
micro-batches, ``optimizer.step()``) on fixed random-token batches pre-generated on the device:
  re-quantize       1 micro-batch per step with Megatron's ``get_forward_backward_func``: the weights are
                    fake-quantized again on every step (every micro-batch)
  reuse             ``--micro-batches`` (4) per step with ``modelopt_moe.plugins.megatron.get_forward_backward_func``:
                    the weights are fake-quantized once per step and reused by the other micro-batches
bf16 runs both modes too, and every ratio is to bf16 in the same mode and the same round.

Every variant is built first, then timed in alternating rounds (every round runs every variant, each round in the
reverse order of the one before): host-bound timings drift between runs on shared machines. The table gives the
median ms per optimizer step (and per micro-batch) over the rounds, and the median and range of the per-round ratio
to bf16.

Residency: one variant holds about 18 bytes per parameter between steps (bf16 weights, fp32 gradients, fp32 main
weights, Adam's two moments), about 24 GiB at the defaults, so not every variant fits on the GPU at once (an 80 GB
H100 holds two beside the steps' working memory, a 141 GB H200 five). As many as fit beside ``--reserve-gib`` stay
resident (``--resident N`` to choose); before another one runs, the least recently run is parked: its weights, main
weights and optimizer state copied to pinned host memory and its GPU storages freed, its gradient buffers dropped.
Moves happen outside the timed region and are followed by the warmup steps; the reversed order of every other round
lets the variants still resident start the next round. The header says how many were resident and how long the
moves took.

Memory, for each variant and mode, from ``torch.cuda.max_memory_allocated`` over one step (after a step of the
same mode, peak statistics reset just before it):
  step +MiB         the step's peak minus ``memory_allocated()`` at its start: what the step itself adds
                    (activations, fake-quantized weight copies, optimizer temporaries), whatever else is resident
  peak MiB          the peak the step reaches with the variant alone on the GPU: the variant's own state (its
                    weights, gradient buffers, main weights, Adam's moments and module buffers such as quantizer
                    amaxes) plus ``step +MiB``. Measured with several variants resident in one process, the
                    absolute peak would also count the others
and each one's ratio to bf16 in the same mode. ``--memory-only`` measures memory and skips the timing rounds.

Models (``--model``):
  qwen3             the Qwen3-MoE-like block above (the default)
  deepseek_v3       DeepSeek-V3 / Kimi-K2: ``build_megatron_model(config, spec="te")`` from a ``DeepseekV3ForCausalLM``
                    config (:data:`FAMILY_CONFIGS`): the real layer shapes (hidden 7168, multi-latent attention with
                    q/kv LoRA ranks 1536/512, qk 128+64 and v 128 head dims, YaRN; experts of FFN 2048 with one shared
                    expert, the sigmoid router with its expert bias, 8 groups top-4, top-8, scaling 2.5; the first
                    layer dense with FFN 18432), scaled to fit one 80 GB GPU with its optimizer: 2 layers (one dense,
                    one MoE), 64 heads (Kimi-K2's; DeepSeek-V3 has 128), 16 routed experts (of 256), vocab 32000
  gpt_oss           gpt-oss: the same from a ``GptOssForCausalLM`` config, gpt-oss-20b's layer shapes (hidden 2880,
                    64 heads of 64 with 8 KV groups, biases on every linear, a learnable sink per head, a 128-token
                    sliding window on every other layer, YaRN; 32 experts of FFN 2880, top-4, the clamped SwiGLU with
                    its +1 offset, grouped experts) in 2 layers (one sliding, one full), vocab 32000
The size options (``--layers``, ``--hidden``, ``--experts``, ...) override the family config's fields. The families'
models print their pieces (attention and expert classes, MLA ranks, dense and shared-expert layers, router, sinks,
windows, biases, activation, rope) and the run stops with an error when one the config asks for is missing, so a
plainer model cannot be timed in its place. ``--tiny`` takes tiny sizes instead (the families' shipped tiny configs,
``configs/<family>_tiny.json``; seq 32, the allgather dispatcher): the CPU smoke run.

Usage (GPU machine, modelopt_moe and Transformer Engine installed):
  python3 tools/bench_megatron_step.py [--model qwen3] [--rounds 5] [--steps 5] [--warmup 1] [--variants bf16 fp8]
Any size is an option (``--help``). Without CUDA it runs on CPU (gloo) with the project's grouped experts and local
layer spec instead of TE (the families: ``spec="local"``, Megatron's ``SequentialMLP`` experts); that is what the CPU
tests do, at tiny sizes: the numbers mean nothing there.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

VARIANTS = ("bf16", "fp8", "nvfp4", "nvfp4_4over6", "fp8-te_fp8", "modelopt-fp8", "modelopt-nvfp4")
MODELS = ("qwen3", "deepseek_v3", "gpt_oss")
MODES = ("re-quantize", "reuse")
PRESETS = {"fp8": "fp8_default.yaml", "nvfp4": "nvfp4_default.yaml", "nvfp4_4over6": "nvfp4_4over6.yaml",
           "fp8-te_fp8": "fp8_default.yaml"}
GEMMS = {"fp8-te_fp8": "te_fp8"}  # variants that override the preset's gemm
MODELOPT_PRESETS = {"modelopt-fp8": "FP8_DEFAULT_CFG", "modelopt-nvfp4": "NVFP4_DEFAULT_CFG"}
MIB = 2**20

# The size options of the Qwen3-MoE-like block, and its tiny ones (--tiny); the families take theirs from their configs
# (FAMILY_CONFIGS, or with --tiny the shipped tiny ones).
QWEN3_SIZES = dict(layers=2, hidden=2048, experts=128, moe_ffn_hidden=768, topk=8, heads=16, kv_heads=4, vocab=32000)
TINY_SIZES = dict(layers=1, hidden=64, experts=4, moe_ffn_hidden=32, topk=2, heads=4, kv_heads=2, vocab=256)

# The families' benchmark configs, as Hugging Face writes them (see the module docstring for what is scaled).
FAMILY_CONFIGS = {
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 32000,
        "hidden_size": 7168, "num_hidden_layers": 2, "first_k_dense_replace": 1, "intermediate_size": 18432,
        "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_interleave": True,
        "n_routed_experts": 16, "moe_intermediate_size": 2048, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "num_nextn_predict_layers": 0, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": 163840,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                            "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                            "mscale": 1.0, "mscale_all_dim": 1.0},
        "attention_bias": False, "tie_word_embeddings": False, "router_aux_loss_coef": 0.0, "torch_dtype": "bfloat16",
    },
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 32000, "hidden_size": 2880,
        "num_hidden_layers": 2, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 32, "intermediate_size": 2880, "num_experts_per_tok": 4, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"], "attention_bias": True, "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
        "tie_word_embeddings": False, "router_aux_loss_coef": 0.0, "torch_dtype": "bfloat16",
    },
}
# The Hugging Face fields each size option sets in a family's config.
_FAMILY_FIELDS = {
    "deepseek_v3": dict(layers=("num_hidden_layers",), hidden=("hidden_size",), experts=("n_routed_experts",),
                        moe_ffn_hidden=("moe_intermediate_size",), topk=("num_experts_per_tok",),
                        heads=("num_attention_heads", "num_key_value_heads"), kv_heads=(), vocab=("vocab_size",)),
    "gpt_oss": dict(layers=("num_hidden_layers",), hidden=("hidden_size",), experts=("num_local_experts",),
                    moe_ffn_hidden=("intermediate_size",), topk=("num_experts_per_tok",),
                    heads=("num_attention_heads",), kv_heads=("num_key_value_heads",), vocab=("vocab_size",)),
}


@dataclasses.dataclass(eq=False)
class Variant:
    """One trained model instance: its ``Trainer`` (DDP model, optimizer) and, while parked, where its state is."""

    name: str
    trainer: object
    weight_quantizers: int
    pieces: str = ""  # a family model's pieces (check_pieces)
    state_bytes: int = 0  # GPU memory it holds between steps (see own_bytes)
    parked: list = dataclasses.field(default_factory=list)  # (storage, bytes, offset in `host` or None)
    host: torch.Tensor | None = None


# ------------------------------------------------------------------------------------------------ setup


def init_distributed(seed: int) -> torch.device:
    """World size 1 (NCCL on a GPU, gloo otherwise) and Megatron's parallel state at TP = EP = 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from modelopt_moe.launch import free_port

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(minutes=10))
    if cuda:
        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return torch.device("cuda", 0)
    # Without CUDA: the project's parallel setup, which applies its CPU shims and seeds a CPU-only RNG tracker.
    from modelopt_moe.plugins.megatron import init_model_parallel

    init_model_parallel(seed=seed)
    return torch.device("cpu")


def have_transformer_engine() -> bool:
    """Whether Transformer Engine imports and a CUDA GPU is there (the TE spec runs only then)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def _config_kwargs(args) -> dict:
    """``TransformerConfig`` fields shared by the TE and the CPU model: a Qwen3-MoE-like block."""
    return dict(
        num_attention_heads=args.heads, num_query_groups=args.kv_heads, num_moe_experts=args.experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden, moe_router_topk=args.topk, moe_grouped_gemm=True,
        moe_token_dispatcher_type=args.dispatcher, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
    )


def build_te_gpt(args, seed: int):
    """The benchmark model on the GPU: Megatron's TE layer spec, Megatron's own initialisation from ``seed``."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.moe_ffn_hidden, **_config_kwargs(args),
        qk_layernorm=True, moe_permute_fusion=True, moe_router_dtype="fp32", params_dtype=torch.bfloat16, bf16=True,
    )
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=args.experts, moe_grouped_gemm=True,
                                                      qk_layernorm=True)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab, max_sequence_length=args.seq,
                     position_embedding_type="rope", rotary_base=1_000_000, share_embeddings_and_output_weights=False)
    return model.cuda()


def build_cpu_gpt(args, seed: int):
    """The same block without TE (the CPU test): the project's grouped experts in Megatron's local spec (no QK norm).
    ``build_moe_gpt`` (the tests' model builder, ``tests/megatron_harness``, not part of the package) takes the expert
    sizes as its own arguments, the other config fields as overrides."""
    tests = str(Path(__file__).resolve().parents[1] / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import megatron_harness.models as mm

    return mm.build_moe_gpt(num_layers=args.layers, hidden=args.hidden, ffn_hidden=args.moe_ffn_hidden,
                            num_experts=args.experts, vocab_size=args.vocab, seq_len=args.seq,
                            moe_router_topk=args.topk, params_dtype=torch.bfloat16, seed=seed, experts="grouped",
                            **{k: v for k, v in _config_kwargs(args).items() if k not in ("num_moe_experts",
                               "moe_ffn_hidden_size", "moe_router_topk", "moe_grouped_gemm")})


def build_family_gpt(args, seed: int):
    """A family's model the way users build it: ``build_megatron_model`` from its Hugging Face config (``args.hf``),
    TE spec on the GPU (local without TE), bf16 parameters, Megatron's own initialisation from ``seed``; the MoE
    settings the Qwen3-MoE-like block has (dispatcher, no load-balancing loss, fp32 router, TE's permute fusion)."""
    from megatron.core import tensor_parallel

    from modelopt_moe.export import build_megatron_model

    te = have_transformer_engine()
    torch.manual_seed(seed)
    # Without CUDA the inference tracker keeps plain torch generators (no CUDA RNG state to seed).
    tensor_parallel.model_parallel_cuda_manual_seed(seed, **({} if te else dict(inference_rng_tracker=True,
                                                                                force_reset_rng=True)))
    overrides = dict(params_dtype=torch.bfloat16, moe_token_dispatcher_type=args.dispatcher,
                     moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_dtype="fp32")
    if te:
        overrides["moe_permute_fusion"] = True
    return build_megatron_model(args.hf, spec="te" if te else "local", **overrides)


def _class_names(modules) -> str:
    return "/".join(sorted({type(m).__name__ for m in modules})) or "-"


def _has_bias(linear) -> bool:
    """Whether a Megatron or Transformer Engine linear (grouped too) has a bias (TE's keep ``use_bias``)."""
    return bool(getattr(linear, "use_bias", getattr(linear, "bias", None) is not None))


def _window(core) -> tuple[int, int] | None:
    """A core attention's sliding window (TE's ``window_size``, Megatron's on its softmax), None for full attention
    (TE's ``(-1, 0)``)."""
    w = getattr(core, "window_size", None)
    if w is None:
        w = getattr(getattr(core, "scale_mask_softmax", None), "window_size", None)
    return None if w is None or w[0] < 0 else tuple(w)


def model_pieces(model) -> dict:
    """The family pieces the built model has, read from its modules: attention, core attention and expert classes,
    MLA's LoRA ranks, which layers have a dense MLP, shared experts, an expert bias, sinks (layer numbers from 0),
    the router, the windows, which linears have biases, the activation and the rotary embedding."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    c, layers = model.config, list(model.decoder.layers)
    attn = [layer.self_attention for layer in layers]
    core = [a.core_attention for a in attn]
    moe = {i: layer.mlp for i, layer in enumerate(layers) if isinstance(layer.mlp, MoELayer)}
    routers = [m.router for m in moe.values()]
    mla = all(hasattr(a, "linear_kv_down_proj") for a in attn)
    experts = moe[min(moe)].experts if moe else None
    if hasattr(experts, "local_experts"):  # SequentialMLP
        experts = experts.local_experts[0]
    expert_fc1 = getattr(experts, "linear_fc1", None)
    biases = {"qkv": all(_has_bias(a.linear_qkv) for a in attn if hasattr(a, "linear_qkv")) and not mla,
              "proj": all(_has_bias(a.linear_proj) for a in attn),
              "router": bool(routers) and all(r.bias is not None for r in routers),
              "experts": expert_fc1 is not None and _has_bias(expert_fc1)}
    rope = getattr(attn[0], "rotary_pos_emb", None) or getattr(model, "rotary_pos_emb", None)
    clamp = c.activation_func_clamp_value
    return {
        "attention": _class_names(attn), "core attention": _class_names(core),
        "experts": _class_names(m.experts for m in moe.values()),
        "MLA q/kv LoRA ranks": (c.q_lora_rank, c.kv_lora_rank) if mla else None,
        "dense MLP layers": [i for i in range(len(layers)) if i not in moe],
        "shared experts": [i for i, m in moe.items() if getattr(m, "shared_experts", None) is not None],
        "router": f"{c.moe_router_score_function} top-{c.moe_router_topk}",
        "router groups": (c.moe_router_num_groups, c.moe_router_group_topk) if c.moe_router_num_groups else None,
        "expert bias": [i for i, m in moe.items() if getattr(m.router, "expert_bias", None) is not None],
        "sinks": [i for i, a in enumerate(core) if getattr(a, "softmax_offset", None) is not None],
        "windows": [_window(a) for a in core],
        "biases": [k for k, v in biases.items() if v],
        "activation": (f"{getattr(c.activation_func, '__name__', c.activation_func)}"
                       + (f" GLU +{c.glu_linear_offset:g}" if c.glu_linear_offset else "")
                       + (f" clamped at {clamp:g}" if clamp else "")),
        "rope": type(rope).__name__ if rope is not None else None,
    }


def expected_pieces(model_name: str, hf: dict, te: bool) -> dict:
    """The pieces a family's config asks for (the keys of :func:`model_pieces` it decides)."""
    n = hf["num_hidden_layers"]
    yarn = (hf.get("rope_parameters") or {}).get("rope_type") == "yarn"
    if model_name == "deepseek_v3":
        dense = int(hf.get("first_k_dense_replace") or 0)
        groups = int(hf.get("n_group") or 1)
        return {"attention": "MLASelfAttention",
                "core attention": "TEDotProductAttention" if te else "LatentDotProductAttention",
                "experts": "TEGroupedMLP" if te else "SequentialMLP",
                "MLA q/kv LoRA ranks": (hf["q_lora_rank"], hf["kv_lora_rank"]), "dense MLP layers": list(range(dense)),
                "shared experts": list(range(dense, n)) if hf.get("n_shared_experts") else [],
                "router": f"sigmoid top-{hf['num_experts_per_tok']}", "expert bias": list(range(dense, n)),
                "router groups": (groups, hf["topk_group"]) if groups > 1 else None,
                "rope": "YarnRotaryEmbedding" if yarn else "RotaryEmbedding"}
    window = hf.get("sliding_window")
    return {"attention": "SelfAttention", "core attention": "TEDotProductAttention" if te else "DotProductAttention",
            "experts": "TEGroupedMLP" if te else "SequentialMLP", "MLA q/kv LoRA ranks": None,
            "sinks": list(range(n)),
            "windows": [(window - 1, 0) if t == "sliding_attention" else None for t in hf["layer_types"]],
            "biases": ["qkv", "proj", "router", "experts"] if hf.get("attention_bias") else [],
            "activation": f"quick_gelu GLU +1 clamped at {hf['swiglu_limit']:g}",
            "rope": "YarnRotaryEmbedding" if yarn else "RotaryEmbedding"}


def check_pieces(model, args) -> str:
    """The built family model's pieces on one line; raises when one its config asks for is missing or different (a
    plainer model must not be timed in its place)."""
    have = model_pieces(model)
    want = expected_pieces(args.model, args.hf, have_transformer_engine())
    wrong = [f"{k}: expected {v!r}, built {have[k]!r}" for k, v in want.items() if have[k] != v]
    if wrong:
        raise RuntimeError(f"--model {args.model}: the built model lacks pieces of its config: " + "; ".join(wrong))
    shown = {k: v for k, v in have.items() if v not in (None, [], "-")}
    if all(w is None for w in shown.get("windows", [])):
        shown.pop("windows", None)  # full attention everywhere
    return ", ".join(f"{k} {v}" for k, v in shown.items())


def random_batches(args, count: int, device: torch.device, seed: int) -> list[dict[str, torch.Tensor]]:
    """``count`` micro-batches of random tokens and labels on ``device``. TE's causal attention takes no mask;
    Megatron's local attention would build its default one on a literal ``"cuda"`` device, so it gets one on CPU."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (args.micro_batch, args.seq)
    positions = torch.arange(args.seq, device=device).expand(shape)
    mask = None
    if not have_transformer_engine():
        mask = torch.ones(args.seq, args.seq, dtype=torch.bool, device=device).triu(1)[None, None]
    return [{"tokens": torch.randint(args.vocab, shape, device=device, generator=gen),
             "labels": torch.randint(args.vocab, shape, device=device, generator=gen),
             "position_ids": positions, "attention_mask": mask} for _ in range(count)]


def _forward(model, batch) -> torch.Tensor:
    return model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])


def _lm_loss(model, batch) -> torch.Tensor:
    return _forward(model, batch).float().mean()


def forward_step(data_iterator, model):
    """Megatron's forward-step contract: the output and a loss function of it."""
    output = _forward(model, next(data_iterator))

    def loss_func(out):
        loss = out.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def quantize(name: str, model, calib: list[dict[str, torch.Tensor]], backward: str | None = None):
    """Quantize ``model`` for variant ``name`` after calibrating on ``calib`` (eval mode, no gradients); ``backward``:
    our variants' ``backward.mode`` (None: the preset's)."""
    def forward_loop(m):
        with torch.no_grad():
            for batch in calib:
                _lm_loss(m, batch)

    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name in PRESETS:
            import modelopt_moe.quantization as mtq

            cfg = mtq.load_config(PRESETS[name])
            cfg.gemm = GEMMS.get(name, cfg.gemm)
            if backward:
                cfg.backward.mode = backward
            mtq.quantize(model, cfg, forward_loop)
        else:
            import modelopt.torch.quantization as mto

            mto.quantize(model, copy.deepcopy(getattr(mto, MODELOPT_PRESETS[name])), forward_loop)
    return model.train()


def modelopt_unavailable(name: str) -> str | None:
    """Why Model Optimizer's variant ``name`` cannot run here, or None. It is skipped up front rather than caught: a
    Model Optimizer forward that raises leaves Megatron's linear function patched for every model in the process."""
    try:
        import modelopt.torch.quantization  # noqa: F401
    except Exception as exc:  # an ImportError, or its Megatron / TE plugin failing to import
        return f"modelopt does not import ({type(exc).__name__}: {exc})"
    if name == "modelopt-nvfp4" and not torch.cuda.is_available():
        return "Model Optimizer's NVFP4 fake quantization needs CUDA"
    return None


def count_weight_quantizers(model) -> int:
    """Enabled weight quantizers (ours and Model Optimizer's both name them ``*weight_quantizer``)."""
    return sum(1 for name, m in model.named_modules()
               if name.endswith("weight_quantizer") and getattr(m, "is_enabled", False))


def build_variant(name: str, args, calib, seed: int) -> Variant:
    """The model of variant ``name`` (quantized after calibrating on ``calib``, except ``bf16``) with its trainer."""
    from modelopt_moe.plugins.megatron import training as mt

    if args.model != "qwen3":
        model = build_family_gpt(args, seed)
        pieces = check_pieces(model, args)
    else:
        model = build_te_gpt(args, seed) if have_transformer_engine() else build_cpu_gpt(args, seed)
        pieces = ""
    if name != "bf16":
        model = quantize(name, model, calib, args.backward)
    quantizers = count_weight_quantizers(model)
    return Variant(name, mt.setup_training(model), quantizers, pieces)


# ------------------------------------------------------------------------------------------------ one step


def schedules() -> dict[str, object]:
    """The ``forward_backward_func`` of each mode."""
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_schedule

    from modelopt_moe.plugins.megatron import get_forward_backward_func as reusing_schedule

    return {"re-quantize": megatron_schedule(), "reuse": reusing_schedule()}


def train_step(variant: Variant, schedule, batches: list[dict[str, torch.Tensor]]) -> None:
    """One optimizer step over ``batches`` (one micro-batch each)."""
    from modelopt_moe.plugins.megatron_cpu import megatron_training_shims

    model, optimizer = variant.trainer.model, variant.trainer.optimizer
    seq = batches[0]["tokens"].shape[1]
    with megatron_training_shims():  # a no-op with CUDA; Megatron's DDP and optimizer need it on CPU only
        model.zero_grad_buffer()
        optimizer.zero_grad()
        schedule(forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                 num_microbatches=len(batches), seq_length=seq, micro_batch_size=batches[0]["tokens"].shape[0],
                 decoder_seq_length=seq, forward_only=False)
        update_successful, _, _ = optimizer.step()
    if not update_successful:
        raise RuntimeError(f"{variant.name}: the optimizer skipped the step (non-finite gradients)")


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(step, steps: int) -> float:
    """Mean ms per call of ``step`` over ``steps`` calls (CUDA events around all of them; a wall clock on CPU)."""
    _synchronize()
    if not torch.cuda.is_available():
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - start) * 1e3 / steps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def step_memory(step) -> int | None:
    """Peak bytes one call of ``step`` allocates on top of what was allocated when it started; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


# ------------------------------------------------------------------------------------------------ parking


def _state_storages(variant: Variant) -> list[tuple[torch.UntypedStorage, bool]]:
    """The variant's large GPU storages and whether their values must survive parking: DDP's parameter buffers
    (yes) and gradient buffers (no: every step zeroes them), the optimizer's main parameters and state (yes)."""
    ddp, optimizer = variant.trainer.model, variant.trainer.optimizer
    tensors = []
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        tensors += [(buffer.param_data, True), (buffer.grad_data, False)]
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.optimizer.param_groups:
            tensors += [(p, True) for p in group["params"]]
        for state in opt.optimizer.state.values():
            tensors += [(v, True) for v in state.values() if torch.is_tensor(v)]
    unique = {}
    for t, keep in tensors:
        if t is not None and t.is_cuda:
            unique.setdefault(t.untyped_storage().data_ptr(), (t.untyped_storage(), keep))
    return list(unique.values())


def own_bytes(variant: Variant) -> int:
    """GPU bytes the variant holds between steps: its state storages and its module buffers (quantizer amaxes)."""
    storages = {s.data_ptr(): s for s, _ in _state_storages(variant)}
    for b in variant.trainer.model.module.buffers():  # DDP's own ``buffers`` attribute is its gradient buffers
        if b.is_cuda:
            storages.setdefault(b.untyped_storage().data_ptr(), b.untyped_storage())
    return sum(s.nbytes() for s in storages.values())


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


def _pinned(nbytes: int) -> torch.Tensor:
    """Exactly ``nbytes`` of page-locked host memory (``pin_memory=True`` would round up to a power of two)."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0))
    return host


class Residency:
    """Which variants hold their state on the GPU: at most ``limit`` at once (None: no limit). Before another one
    runs, the least recently run is parked: its weights and optimizer state are copied to pinned host memory (a
    pool of buffers, reused as variants come and go) and its GPU storages freed, the gradient buffers dropped.
    Tensors and views keep their identity (only the storages are resized, as Megatron's own offload helpers do), so
    Megatron's DDP and optimizer see nothing. ``moved_s`` counts the seconds spent parking and bringing back."""

    def __init__(self, limit: int | None):
        self.limit, self.resident, self.free_buffers, self.moved_s = limit, [], [], 0.0

    def make_room(self) -> None:
        """Park variants until one more fits."""
        while self.limit is not None and len(self.resident) >= self.limit:
            self._park(self.resident.pop(0))

    def activate(self, variant: Variant) -> None:
        """Make ``variant`` resident (the most recently run)."""
        if variant in self.resident:
            self.resident.remove(variant)
        else:
            self.make_room()
            self._unpark(variant)
        self.resident.append(variant)

    def _park(self, variant: Variant) -> None:
        start = time.perf_counter()
        variant.trainer.optimizer.zero_grad()  # main-parameter gradients are views of the gradient buffers
        storages = _state_storages(variant)
        need = sum(s.nbytes() for s, keep in storages if keep)
        fits = [b for b in self.free_buffers if b.numel() >= need]
        variant.host = fits[0] if fits else _pinned(need)
        if fits:
            self.free_buffers.remove(variant.host)
        offset = 0
        for storage, keep in storages:
            variant.parked.append((storage, storage.nbytes(), offset if keep else None))
            if keep:
                variant.host[offset:offset + storage.nbytes()].copy_(_bytes_of(storage), non_blocking=True)
                offset += storage.nbytes()
        torch.cuda.synchronize()
        for storage, _, _ in variant.parked:
            storage.resize_(0)
        self.moved_s += time.perf_counter() - start

    def _unpark(self, variant: Variant) -> None:
        start = time.perf_counter()
        for storage, nbytes, offset in variant.parked:
            storage.resize_(nbytes)
            if offset is None:
                _bytes_of(storage).zero_()
            else:
                _bytes_of(storage).copy_(variant.host[offset:offset + nbytes], non_blocking=True)
        torch.cuda.synchronize()
        if variant.host is not None:
            self.free_buffers.append(variant.host)
        variant.parked, variant.host = [], None
        self.moved_s += time.perf_counter() - start


def resident_limit(args, state_bytes: int) -> int | None:
    """How many variants of ``state_bytes`` each fit on the GPU beside ``--reserve-gib`` for the steps."""
    if args.resident:
        return args.resident
    if not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(0).total_memory
    return max(1, int((total - args.reserve_gib * 2**30) // max(state_bytes, 1)))


# ------------------------------------------------------------------------------------------------ the benchmark


def _ratios(times: dict, name: str, mode: str) -> list[float]:
    if ("bf16", mode) not in times:
        return []
    return [t / b for t, b in zip(times[name, mode], times["bf16", mode], strict=True)]


def make_rows(names: list[str], modes: dict[str, int], times: dict, memory: dict) -> list[dict]:
    """One row per variant and mode (the table's and the JSON's); ratios are to bf16 in the same mode."""
    rows = []
    for name in names:
        for mode, micro_batches in modes.items():
            mem, base = memory.get((name, mode)), memory.get(("bf16", mode))
            row = {"variant": name, "mode": mode, "micro_batches": micro_batches,
                   "peak_mib": mem[0] / MIB if mem else None, "step_mib": mem[1] / MIB if mem else None,
                   "peak_x_bf16": mem[0] / base[0] if mem and base else None,
                   "step_x_bf16": mem[1] / base[1] if mem and base and base[1] > 0 else None}
            if times:
                ms, ratios = times[name, mode], _ratios(times, name, mode)
                row.update(ms=statistics.median(ms), ms_per_micro_batch=statistics.median(ms) / micro_batches,
                           x_bf16=statistics.median(ratios) if ratios else None,
                           x_bf16_min=min(ratios, default=None), x_bf16_max=max(ratios, default=None))
            rows.append(row)
    return rows


def _fmt(value, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def format_table(rows: list[dict], timed: bool) -> str:
    """The results as a text table: time (when ``timed``) and memory of each variant and mode, and their ratios to
    bf16."""
    head = f"{'variant':<15} {'mode':<18}"
    if timed:
        head += f" {'ms/step':>9} {'ms/micro-batch':>15} {'x bf16 (median)':>16} {'x bf16 range':>13}"
    head += f" {'peak MiB':>10} {'x bf16':>7} {'step +MiB':>10} {'x bf16':>7}"
    lines = [head]
    for r in rows:
        line = f"{r['variant']:<15} {r['mode'] + ' (' + str(r['micro_batches']) + ' mb)':<18}"
        if timed:
            spread = "-" if r["x_bf16_min"] is None else f"{r['x_bf16_min']:.2f}..{r['x_bf16_max']:.2f}"
            line += (f" {r['ms']:>9.2f} {r['ms_per_micro_batch']:>15.2f} {_fmt(r['x_bf16'], '.2f', 16)}"
                     f" {spread:>13}")
        line += (f" {_fmt(r['peak_mib'], '.0f', 10)} {_fmt(r['peak_x_bf16'], '.2f', 7)}"
                 f" {_fmt(r['step_mib'], '.0f', 10)} {_fmt(r['step_x_bf16'], '.2f', 7)}")
        lines.append(line)
    return "\n".join(lines)


def environment_line(device: torch.device) -> str:
    """The device, and the torch, Transformer Engine and megatron-core versions, on one line."""
    import megatron.core

    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    te = "not installed"
    if have_transformer_engine():
        import transformer_engine

        te = getattr(transformer_engine, "__version__", "?")
    return f"{name}, torch {torch.__version__}, Transformer Engine {te}, megatron-core {megatron.core.__version__}"


@dataclasses.dataclass
class Steps:
    """The optimizer step of each mode (name -> micro-batches per step) on fixed batches."""

    modes: dict[str, int]
    batches: list[dict[str, torch.Tensor]]
    schedules: dict[str, object]

    def __call__(self, variant: Variant, mode: str):
        """A no-argument call running one optimizer step of ``variant`` in ``mode``."""
        return lambda: train_step(variant, self.schedules[mode], self.batches[:self.modes[mode]])


def prepare(name: str, args, calib, steps: Steps, residency: Residency) -> tuple[Variant, dict]:
    """Build a variant, run a step of each mode (Adam's state exists after the first) and measure the next one.
    Returns the variant and ``{(name, mode): (peak bytes of a step with the variant alone on the GPU, step
    increment bytes)}`` (None without CUDA)."""
    residency.make_room()
    clock = time.perf_counter()
    variant = build_variant(name, args, calib, args.seed)
    built = time.perf_counter()
    increments = {}
    for mode in steps.modes:
        steps(variant, mode)()
        increments[mode] = step_memory(steps(variant, mode))
    variant.state_bytes = own_bytes(variant)
    residency.resident.append(variant)
    if residency.limit is None:
        residency.limit = resident_limit(args, variant.state_bytes)
    print(f"built {name}: {variant.weight_quantizers} weight quantizers enabled, {variant.state_bytes / MIB:.0f} MiB "
          f"of state; {built - clock:.1f} s to build, {time.perf_counter() - built:.1f} s for the first steps")
    memory = {(name, mode): None if inc is None else (variant.state_bytes + inc, inc)
              for mode, inc in increments.items()}
    return variant, memory


def time_rounds(variants: list[Variant], steps: Steps, args, residency: Residency) -> dict[tuple[str, str], list]:
    """``{(variant, mode): [ms per step of each round]}``: every round runs every variant, in the reverse order of
    the round before (the first round starts with the last built), so the variants still on the GPU go first."""
    times = {(v.name, mode): [] for v in variants for mode in steps.modes}
    for r in range(args.rounds):
        for variant in variants[::-1] if r % 2 == 0 else variants:
            residency.activate(variant)
            for mode in steps.modes:
                for _ in range(args.warmup):
                    steps(variant, mode)()
                times[variant.name, mode].append(time_steps(steps(variant, mode), args.steps))
    return times


def _family_details(hf: dict) -> str:
    """What a family's header adds to the sizes: its layer kinds and attention."""
    if "kv_lora_rank" in hf:
        return (f"{hf.get('first_k_dense_replace') or 0} dense of FFN {hf['intermediate_size']}, MLA q/kv LoRA "
                f"{hf['q_lora_rank']}/{hf['kv_lora_rank']}, {hf.get('n_shared_experts') or 0} shared expert(s), "
                f"sigmoid router with expert bias, {hf.get('n_group') or 1} groups top-{hf.get('topk_group') or 1}")
    sliding = sum(t == "sliding_attention" for t in hf["layer_types"])
    return (f"{sliding} with a {hf['sliding_window']}-token window, attention sinks, biases, SwiGLU clamped at "
            f"{hf['swiglu_limit']:g}")


def header(args, device: torch.device, residency: Residency, variants: int) -> str:
    """The table's header: the model, the environment, what was measured and where the variants lived."""
    spec = "TE spec" if have_transformer_engine() else "local spec and the project's grouped experts, no TE"
    model = ""
    if args.model != "qwen3":
        spec = (f"{args.model}-shaped, build_megatron_model(spec={'te' if have_transformer_engine() else 'local'!r}) "
                "from its Hugging Face config")
        model = f" ({_family_details(args.hf)})"
    what = "memory only" if args.memory_only else (
        f"{args.rounds} alternating rounds of {args.steps} timed steps ({args.warmup} warmup) per variant and mode")
    if device.type != "cuda":
        where = "; memory is measured on CUDA only"
    elif residency.limit is not None and residency.limit < variants:
        where = (f"; {residency.limit} of {variants} variants on the GPU at once, the others parked in host memory "
                 f"({residency.moved_s:.0f} s of moves, untimed)")
    else:
        where = "; every variant on the GPU at once"
    return (f"Megatron GPTModel MoE training step ({spec}): {args.layers} layers{model}, hidden {args.hidden}, "
            f"{args.experts} experts x FFN {args.moe_ffn_hidden} top-{args.topk}, {args.heads} heads "
            f"({args.kv_heads} KV), seq {args.seq}, micro-batch {args.micro_batch}, vocab {args.vocab}, "
            f"{args.dispatcher} dispatcher, bf16 + Adam (distributed optimizer)"
            f"{f', backward.mode {args.backward}' if args.backward else ''}\n"
            f"{environment_line(device)}; {what}{where}")


def run(args) -> list[dict]:
    """Build every variant, measure memory, time the alternating rounds, print the table; returns its rows."""
    device = init_distributed(args.seed)
    names = list(dict.fromkeys(args.variants))
    for name in [n for n in names if n in MODELOPT_PRESETS]:
        reason = modelopt_unavailable(name)
        if reason:
            print(f"skipped {name}: {reason}")
            names.remove(name)
    modes = {m: 1 if m == "re-quantize" else args.micro_batches for m in dict.fromkeys(args.modes)}
    calib = random_batches(args, args.calib_batches, device, args.seed + 1)
    steps = Steps(modes, random_batches(args, max(modes.values()), device, args.seed + 2), schedules())
    residency = Residency(args.resident or None)

    variants, memory = [], {}
    for name in names:
        variant, mem = prepare(name, args, calib, steps, residency)
        if variant.pieces and not variants:
            print(f"{args.model} model pieces: {variant.pieces}")
        variants.append(variant)
        memory.update(mem)
    times = {} if args.memory_only else time_rounds(variants, steps, args, residency)

    rows = make_rows([v.name for v in variants], modes, times, memory)
    print("\n" + header(args, device, residency, len(variants)))
    print(format_table(rows, timed=bool(times)))
    return rows


def parse_args(argv=None):
    """The command line's options (``argv``: None for ``sys.argv``); exits with a message on a bad value."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="qwen3", help="the model's shape (see above)")
    p.add_argument("--tiny", action="store_true", help="tiny sizes, seq 32 and the allgather dispatcher (CPU smoke)")
    given = "(default: the model's; qwen3: %s)"
    for option, key, what in (("--layers", "layers", ""), ("--hidden", "hidden", ""), ("--experts", "experts", ""),
                              ("--moe-ffn-hidden", "moe_ffn_hidden", "experts' FFN size "),
                              ("--topk", "topk", ""), ("--heads", "heads", ""),
                              ("--kv-heads", "kv_heads", "query groups (GQA) "), ("--vocab", "vocab", "")):
        p.add_argument(option, type=int, default=None, help=what + given % QWEN3_SIZES[key])
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: 4096; 32 with --tiny)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--dispatcher", choices=("alltoall", "allgather"), default=None,
                   help="token dispatcher (default: alltoall; allgather with --tiny)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step in the reuse mode")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--backward", choices=("dequantized", "high_precision", "quantized"), default=None,
                   help="backward.mode of our quantized variants (default: the preset's, dequantized)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps per variant, mode and round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    p.add_argument("--calib-batches", type=int, default=2)
    p.add_argument("--memory-only", action="store_true", help="measure memory, skip the timing rounds")
    p.add_argument("--resident", type=int, default=0,
                   help="variants kept on the GPU at once (default: as many as fit beside --reserve-gib)")
    p.add_argument("--reserve-gib", type=float, default=12.0,
                   help="GPU memory kept free for the steps when deciding how many variants fit")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", help="also write the table's rows to this file")
    args = p.parse_args(argv)
    if min(args.rounds, args.steps, args.micro_batches) < 1 or min(args.warmup, args.resident) < 0:
        p.error("--rounds, --steps and --micro-batches must be >= 1, --warmup and --resident >= 0")
    resolve_model(p, args)
    return args


def resolve_model(parser, args) -> None:
    """Fills in the options left out, from ``--model`` and ``--tiny``; for a family, ``args.hf`` is its Hugging Face
    config with the size options given applied, and the size options are read back from it (the header's)."""
    given = {k: getattr(args, k) for k in QWEN3_SIZES}
    args.seq = args.seq or (32 if args.tiny else 4096)
    args.dispatcher = args.dispatcher or ("allgather" if args.tiny else "alltoall")
    args.hf = None
    if args.model == "qwen3":
        for key, value in (TINY_SIZES if args.tiny else QWEN3_SIZES).items():
            if given[key] is None:
                setattr(args, key, value)
        return
    if args.tiny:
        from modelopt_moe.quantization.config import preset_path

        hf = json.loads(preset_path(f"{args.model}_tiny.json").read_text())
    else:
        hf = copy.deepcopy(FAMILY_CONFIGS[args.model])
    fields = _FAMILY_FIELDS[args.model]
    for key, value in given.items():
        if value is not None and not fields[key]:
            parser.error(f"--{key.replace('_', '-')}: {args.model}'s multi-latent attention has a key and a value "
                         "head per query head (set --heads)")
        for field in fields[key] if value is not None else ():
            hf[field] = value
    layers = hf["num_hidden_layers"]
    if "layer_types" in hf and len(hf["layer_types"]) != layers:  # gpt-oss: sliding windows on every other layer
        hf["layer_types"] = [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]
    if hf.get("first_k_dense_replace", 0) >= layers:  # DeepSeek-V3: at least one MoE layer
        hf["first_k_dense_replace"] = layers - 1
    args.hf = hf
    for key, f in fields.items():
        setattr(args, key, hf[f[0]] if f else hf["num_key_value_heads"])


def main(argv=None) -> int:
    """Runs the benchmark, prints the table, writes ``--json``; returns 1 when a step time is not a positive number."""
    import torch.distributed as dist

    args = parse_args(argv)
    try:
        rows = run(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    bad = [r for r in rows if "ms" in r and not (math.isfinite(r["ms"]) and r["ms"] > 0)]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
