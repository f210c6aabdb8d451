"""QAT through Megatron's real training machinery on 4 gloo ranks (TP=2 x EP=2, 8 experts).

The flow users run: build a Megatron MoE GPT (bf16), ``mtq.quantize`` it (FP8, vectorized expert weight amax), wrap
it in ``Float16Module`` + Megatron DDP, build ``get_megatron_optimizer`` (Adam, fp32 main params, distributed
optimizer) and train with ``get_forward_backward_func`` (2 micro-batches per step). After training, the model's
quantized forward must equal, bit for bit, that of a freshly built and quantized model given the trained weights and
every quantizer amax: a forward that still used pre-step weights anywhere (a stale cache) shows up as a difference.

One spawn runs every case (a spawn costs ~15 s of imports): SequentialMLP and grouped (TEGroupedMLP) experts in that
flow, plus a control: grouped experts with fp32 parameters and Megatron's non-distributed FP32 optimizer, which steps
torch's AdamW on the parameters themselves (so ``Tensor._version`` does change), and must be exact.
"""

import math
import traceback
import zlib

import pytest
import torch

from modelopt_moe.launch import spawn

WORLD, TP, EP, EXPERTS, SEED = 4, 2, 2, 8, 1234
KINDS = ("sequential", "grouped")
# case -> (experts, bf16 params + Float16Module, distributed optimizer)
CASES = {
    "sequential": ("sequential", True, True),
    "grouped": ("grouped", True, True),
    "grouped_fp32_local_optimizer": ("grouped", False, False),
}
STEPS, MICROBATCHES = 5, 2
BATCH, SEQ = 2, 32
EMBEDDING = "embedding.word_embeddings.weight"
# build_moe_gpt overrides under which both expert kinds must build the same model
VARIANTS = {"default": {}, "glu_bias": {"gated_linear_unit": True, "add_bias_linear": True}}


def _quantize(model, batches, mtq, mm):
    cfg = mtq.load_config("fp8_default.yaml")
    cfg.experts.weight_amax = "vectorized"
    model.eval()
    mtq.quantize(model, cfg, lambda m: [mm.lm_loss(m, b) for b in batches])
    model.train()
    return model


def _amax_buffers(module):
    return {n: b for n, b in module.named_buffers() if n.rsplit(".", 1)[-1] == "_amax"}


def _train_and_compare(case, calib, train_batches, eval_batch):
    from megatron.core.transformer.module import Float16Module

    import modelopt_moe.quantization as mtq
    from modelopt_moe.testing import megatron_models as mm
    from modelopt_moe.testing import megatron_training as mt

    kind, bf16, distributed = CASES[case]
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = _quantize(mm.build_moe_gpt(num_experts=EXPERTS, seed=SEED, experts=kind, params_dtype=dtype),
                      calib, mtq, mm)
    initial = {n: p.detach().clone() for n, p in mm.iter_params_with_global_names(model)}
    trainer = mt.setup_training(model, bf16=bf16, use_distributed_optimizer=distributed)
    losses = mt.train(trainer, train_batches, steps=STEPS, num_microbatches=MICROBATCHES)
    changed = {n: not torch.equal(initial[n], p) for n, p in mm.iter_params_with_global_names(mt.unwrap(trainer.model))}
    trainer.model.eval()
    with torch.no_grad():
        trained_logits = mm.gather_logits(trainer.model, eval_batch)

    # A fresh model of the same layout, quantized the same way and wrapped the same way (Float16Module casts the
    # amax buffers too), then given the trained weights and every quantizer amax.
    fresh = _quantize(mm.build_moe_gpt(num_experts=EXPERTS, seed=SEED, experts=kind, params_dtype=dtype),
                      calib, mtq, mm)
    if bf16:
        fresh = Float16Module(fresh.config, fresh)
    trained = trainer.model.module  # what DDP wraps: the Float16Module (bf16) or the GPTModel
    src_params, dst_params = dict(trained.named_parameters()), dict(fresh.named_parameters())
    src_amax, dst_amax = _amax_buffers(trained), _amax_buffers(fresh)
    assert src_params.keys() == dst_params.keys()
    assert src_amax.keys() == dst_amax.keys() and src_amax
    with torch.no_grad():
        for name, p in dst_params.items():
            p.copy_(src_params[name])
        for name, a in dst_amax.items():
            a.copy_(src_amax[name])
    fresh.eval()
    with torch.no_grad():
        fresh_logits = mm.gather_logits(fresh, eval_batch)
    return {
        "losses": losses,
        "changed": changed,
        "equal": torch.equal(trained_logits, fresh_logits),
        "max_abs_diff": (trained_logits.float() - fresh_logits.float()).abs().max().item(),
        "num_amax": len(src_amax),
    }


def _same_model_both_kinds(eval_batch, calib, **overrides):
    """Sequential and grouped experts built from one seed (fp32): same weights, logits, gradients and checkpoint keys,
    before and after quantization."""
    import modelopt_moe.quantization as mtq
    from modelopt_moe.testing import megatron_models as mm

    models = {k: mm.build_moe_gpt(num_experts=EXPERTS, seed=SEED, experts=k, **overrides).eval() for k in KINDS}
    with torch.no_grad():  # biases are built as zeros: give them values (by global name) so their path counts
        for m in models.values():
            for n, p in mm.iter_params_with_global_names(m):
                if n.endswith("bias") and "norm" not in n:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(n.encode()))))
    params = {k: dict(mm.iter_params_with_global_names(m)) for k, m in models.items()}

    def sharded(m):
        return sorted({(v.key, tuple(getattr(v, "global_shape", ())), tuple(getattr(v, "global_offset", ())),
                        v.replica_id) for v in m.sharded_state_dict().values()})

    def logits():
        with torch.no_grad():
            return [mm.gather_logits(m.eval(), eval_batch) for m in models.values()]

    def grads():
        out = []
        for m in models.values():
            m.train()
            m.zero_grad()
            mm.lm_loss(m, calib[0]).backward()
            out.append({n: p.grad for n, p in mm.iter_params_with_global_names(m)})
        return out

    out = {"param_names_equal": params["sequential"].keys() == params["grouped"].keys(),
           "sharded_keys_equal": sharded(models["sequential"]) == sharded(models["grouped"])}
    out["params_equal"] = out["param_names_equal"] and all(
        torch.equal(params["sequential"][n], params["grouped"][n]) for n in params["sequential"])
    out["logits_equal"] = torch.equal(*logits())
    for m in models.values():
        _quantize(m, calib, mtq, mm)
    out["quant_logits_equal"] = torch.equal(*logits())
    seq, grp = grads()
    out["quant_grads_equal"] = seq.keys() == grp.keys() and all(torch.equal(seq[n], grp[n]) for n in seq)
    out["quant_sharded_keys_equal"] = sharded(models["sequential"]) == sharded(models["grouped"])
    out["grouped_quantized_class"] = type(models["grouped"].decoder.layers[0].mlp.experts.linear_fc1).__name__
    return out


def _shim_checks():
    """What megatron_training_shims does inside, and that it restores torch.cuda on exit."""
    from modelopt_moe.testing.megatron_cpu import megatron_training_shims

    before = torch.cuda.current_stream
    x = torch.ones(2, dtype=torch.bfloat16)
    with megatron_training_shims() as active:
        inside = {
            "active": active,
            "factory_device": str(torch.zeros(1, device="cuda").device),
            "tensor_device": str(torch.tensor([1.0], device="cuda:0").device),
            "cuda_is_identity": x.cuda() is x,
            "type": (x.type(), torch.zeros(1).type(), x.type(torch.float32).dtype),
            "stream_waits": torch.cuda.current_stream().wait_stream(torch.cuda.Stream()) is None,
        }
    inside["restored"] = torch.cuda.current_stream is before and x.type() == "torch.BFloat16Tensor"
    return inside


def _worker(rank, world_size):
    from modelopt_moe.testing import megatron_models as mm

    out_shims = _shim_checks()
    mm.init_model_parallel(TP, EP, seed=SEED)
    calib = mm.text_batches(BATCH, SEQ, 2)
    train_batches = mm.text_batches(BATCH, SEQ, STEPS * MICROBATCHES, offset=100)
    eval_batch = mm.text_batches(BATCH, SEQ, 1, offset=1000)[0]
    out = {"shims": out_shims, "layout": mm.parallel_layout(),
           "same_model": {name: _same_model_both_kinds(eval_batch, calib, **over) for name, over in VARIANTS.items()}}
    for case in CASES:
        try:
            out[case] = _train_and_compare(case, calib, train_batches, eval_batch)
        except Exception:  # reported by that case's tests; the other cases still run
            out[case] = {"error": traceback.format_exc()}
    mm.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, WORLD, timeout=240)


def _case(results, case):
    for r in results:
        if "error" in r[case]:
            raise RuntimeError(f"{case} case failed on a rank:\n{r[case]['error']}")
    return [r[case] for r in results]


@pytest.mark.timeout(300)
def test_layout(results):
    assert [r["layout"]["tp"] for r in results] == [TP] * WORLD
    assert [r["layout"]["ep"] for r in results] == [EP] * WORLD


@pytest.mark.timeout(300)
def test_training_shims_map_cuda_to_cpu_and_restore(results):
    for r in results:
        s = r["shims"]
        assert s["active"] and s["factory_device"] == "cpu" and s["tensor_device"] == "cpu"
        assert s["cuda_is_identity"] and s["stream_waits"] and s["restored"]
        assert s["type"] == ("torch.cuda.BFloat16Tensor", "torch.cuda.FloatTensor", torch.float32)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_grouped_and_sequential_experts_build_the_same_model(results, variant):
    for r in results:
        s = r["same_model"][variant]
        assert s["param_names_equal"] and s["params_equal"]
        assert s["logits_equal"] and s["quant_logits_equal"] and s["quant_grads_equal"]
        assert s["sharded_keys_equal"] and s["quant_sharded_keys_equal"]
        assert s["grouped_quantized_class"] == "QuantMegatronColumnParallelGroupedLinear"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_training_runs_and_updates_every_weight(results, case):
    cases = _case(results, case)
    for c in cases:
        assert len(c["losses"]) == STEPS and all(math.isfinite(x) for x in c["losses"]), c["losses"]
        assert c["losses"][-1] < c["losses"][0], c["losses"]
        assert c["losses"] == cases[0]["losses"]  # the vocab-parallel loss is the same on every rank
        experts = [n for n in c["changed"] if ".local_experts." in n]
        assert len(experts) == 2 * 2 * EXPERTS // EP  # layers x gemms x local experts
        # The vocab-parallel embedding shard of token ids >= 128 sees no token of the ASCII text: no gradient there.
        unchanged = [n for n, ch in c["changed"].items() if not ch and n != EMBEDDING]
        assert not unchanged, unchanged
    assert any(c["changed"][EMBEDDING] for c in cases)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [
    "sequential",
    pytest.param("grouped", marks=pytest.mark.xfail(
        strict=True, raises=AssertionError,
        reason="stale weight cache: the grouped experts' fake-quantized weights are cached on Tensor._version, "
               "which Megatron's optimizers do not bump, so the forward keeps using pre-step weights")),
    "grouped_fp32_local_optimizer",
])
def test_trained_forward_equals_a_fresh_model_with_the_trained_weights(results, case):
    cases = _case(results, case)
    diffs = [c["max_abs_diff"] for c in cases]
    assert all(c["equal"] for c in cases), f"{case}: max |d logits| per rank {diffs}"
