"""Learned amaxes (``input_amax_update: learned``, ``weight_amax_update: learned``, learned static NVFP4 block
amaxes) on a bf16 Megatron MoE GPT built with Megatron's Transformer Engine spec (``TELayerNormColumnParallelLinear``
and ``TERowParallelLinear`` in attention, ``TEGroupedMLP`` experts on TE grouped linears), trained as a user trains
it: ``Float16Module`` + DDP + Megatron's distributed optimizer + ``get_forward_backward_func``, outside autocast.

Outside autocast TE checks that a layer's parameters have the input's dtype; the learned amaxes are fp32 parameters
of the quantizers under each TE layer. For each kind of quantized TE layer the test asserts that:

* training runs (every step's loss finite) and every learned amax stays an fp32 parameter while the weights are bf16;
* every learned amax is a parameter of the DDP-wrapped model (so Megatron's optimizer holds it) and the optimizer
  steps moved it;
* TE's dtype check still runs on the layer's own parameters: an fp32 input to a bf16 quantized TE linear raises
  ``TypeError``.

Needs a GPU and Transformer Engine; skips otherwise.
"""

import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("transformer_engine.pytorch")

VOCAB, SEQ, BATCH, MICRO, STEPS = 256, 32, 2, 2, 3
TE_LAYERS = ("QuantTELayerNormColumnParallelLinear", "QuantTERowParallelLinear",
             "QuantTEColumnParallelGroupedLinear", "QuantTERowParallelGroupedLinear")
# Weights only (so TE's fused norm-GEMM kernel runs), static NVFP4 block scales: the block amaxes are learned.
LEARNED_BLOCKS = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                                {"quantizer_name": "*weight_quantizer", "cfg": {
                                    "num_bits": (2, 1), "block_sizes": {-1: 16, "type": "static",
                                                                        "scale_bits": (4, 3)}}}],
                  "algorithm": "max", "weight_amax_update": "learned"}


@pytest.fixture(scope="module", autouse=True)
def _megatron(megatron_one_gpu):
    return


def _te_moe_gpt():
    """A 2-layer MoE GPT of Megatron's TE spec, bf16 parameters, on the GPU."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=256, num_moe_experts=4,
        moe_ffn_hidden_size=256, moe_router_topk=2, moe_grouped_gemm=True, moe_token_dispatcher_type="allgather",
        moe_aux_loss_coeff=0.0, normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16, gradient_accumulation_fusion=False)
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=4, moe_grouped_gemm=True)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope").cuda()


def _batches(n, offset):
    g = torch.Generator().manual_seed(offset)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append({"tokens": tokens[:, :-1].cuda(), "labels": tokens[:, 1:].cuda(),
                    "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).cuda(),
                    "loss_mask": torch.ones(BATCH, SEQ).cuda()})
    return out


def _learned_amaxes(model):
    """``{name: (parameter, quantized TE layer class name)}`` of the learned amaxes under quantized TE layers."""
    out = {}
    for mod_name, module in model.named_modules():
        if type(module).__name__ in TE_LAYERS:
            for name, p in module.named_parameters():
                if name.endswith(("_amax", "_block_amax")):
                    out[f"{mod_name}.{name}"] = (p, type(module).__name__)
    return out


def _train(cfg):
    """Quantizes the TE-spec model with ``cfg``, trains it STEPS optimizer steps as the README does; returns the
    wrapped model, the learned amaxes before and after, the losses and the unwrapped model."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    import modelopt_moe.quantization as mtq
    from modelopt_moe.plugins.megatron import get_forward_backward_func, lm_forward_step

    model = _te_moe_gpt().eval()
    calib = _batches(2, offset=1)

    def forward_loop(m):
        with torch.no_grad():
            for b in calib:
                m(b["tokens"], b["position_ids"], None)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, cfg, forward_loop)
    model.train()
    # A learned amax lives where the model and its data are, not on the CPU where it was made before calibration.
    off = {n: str(p.device) for n, (p, _) in _learned_amaxes(model).items() if p.device.type != "cuda"}
    assert not off, off
    before = {n: p.detach().clone() for n, (p, _) in _learned_amaxes(model).items()}
    config = model.config
    wrapped = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                      Float16Module(config, model))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, use_distributed_optimizer=True), [wrapped])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    forward_backward = get_forward_backward_func()
    losses = []
    for step in range(STEPS):
        batches = _batches(MICRO, offset=100 + step)
        wrapped.zero_grad_buffer()
        optimizer.zero_grad()
        reported = forward_backward(forward_step_func=lm_forward_step, data_iterator=iter(batches), model=[wrapped],
                                    num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=BATCH,
                                    forward_only=False)
        ok, _, _ = optimizer.step()
        assert ok, f"step {step}: the optimizer skipped its update"
        losses += [float(v) for r in reported for v in r.values()]
    return wrapped, before, losses, model


@pytest.mark.parametrize("cfg", ["input_and_weight_amax", "nvfp4_block_amax"])
def test_learned_amaxes_train_on_bf16_te_layers_outside_autocast(cfg):
    import modelopt_moe.quantization as mtq

    if cfg == "input_and_weight_amax":
        config = mtq.load_config("nvfp4_default.yaml")
        config.input_amax_update, config.weight_amax_update = "learned", "learned"
        suffixes = ("input_quantizer._amax", "weight_quantizer._amax")
    else:
        config = LEARNED_BLOCKS
        suffixes = ("weight_quantizer._block_amax",)
    wrapped, before, losses, model = _train(config)

    assert len(losses) == STEPS * MICRO
    assert all(torch.isfinite(torch.tensor(losses))), losses
    learned = _learned_amaxes(model)
    for suffix in suffixes:
        kinds = {kind for n, (_, kind) in learned.items() if n.endswith(suffix)}
        assert kinds == set(TE_LAYERS), (suffix, kinds)
    wrapped_params = {id(p) for p in wrapped.parameters()}
    for name, (p, _) in learned.items():
        assert isinstance(p, torch.nn.Parameter), (name, type(p))
        assert p.dtype == torch.float32, (name, p.dtype)
        assert id(p) in wrapped_params, name
        assert not torch.equal(p.detach(), before[name]), f"{name} did not train"
    amax_ids = {id(p) for p, _ in learned.values()}
    te_params = [(f"{m_name}.{n}", p) for m_name, m in model.named_modules() if type(m).__name__ in TE_LAYERS
                 for n, p in m.named_parameters() if id(p) not in amax_ids]
    assert te_params
    assert all(p.dtype == torch.bfloat16 for _, p in te_params), [(n, p.dtype) for n, p in te_params]

    # TE's own dtype check still guards the layer's parameters: an fp32 input to a bf16 TE linear is refused.
    proj = model.decoder.layers[0].self_attention.linear_proj
    with torch.no_grad(), pytest.raises(TypeError, match="weight"):
        proj(torch.randn(SEQ, BATCH, 128, device="cuda"))
