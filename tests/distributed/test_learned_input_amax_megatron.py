"""``input_amax_update: learned`` in Megatron's training machinery on 4 gloo ranks (one spawn for the module).

* Layout invariance: the same model (fp32, every linear FP8, attention TP-sharded; grouped experts with one input
  amax per layer, SequentialMLP experts with one per layer and with one per expert) and the
  same micro-batches at TP=1 x EP=1 (4 data-parallel ranks) and at TP=2 x EP=2 (sequence parallel): the learned input
  amaxes' gradients after Megatron's reduction (``get_forward_backward_func``, 2 micro-batches, DDP, the clip) agree,
  entry by entry (per global expert, one per layer), at every step, and so do the amaxes the optimizer steps make;
  every replica of an amax (TP, DP, EP ranks) holds the same bits.
* bf16 parameters, ``get_megatron_optimizer`` with the distributed optimizer: the learned input amaxes stay fp32
  parameters, the optimizer moves them, and their replicas stay equal.
* Checkpoint: that model saved at TP=2 x EP=2 and loaded at TP=1 x EP=4 into a freshly built one: the same learned
  amaxes by global expert, still learned; the QAD recipe's optimizer puts them in their own parameter groups at
  ``amax_lr_mult`` times its learning rate and floor, without weight decay, and trains a step.
* Export: a Qwen3-MoE built from a transformers checkpoint at TP=2 x EP=2, its input amaxes learned for a step; the
  compressed-tensors export's ``input_scale`` of every quantized linear is the learned amax / 448.
"""

import warnings

import pytest
import torch
from limits import seconds  # noqa: E402
from test_checkpoint_reshard import _gather_union  # noqa: E402 - sibling test module

from modelopt_moe.launch import spawn

WORLD, EXPERTS, SEED = 4, 4, 1234
LAYOUTS = ((1, 1), (2, 2))
CASES = (("grouped", "shared"), ("sequential", "per_expert"), ("sequential", "shared"))
STEPS = 2
# Small enough that the layouts' last-bit differences (sums in other orders) flip no fake-quant bin or routing
# decision in these steps, so each step's gradients are comparable (by a third step one per-expert fc2 gradient
# parts, a token routed elsewhere); large enough that every amax moves.
LR = 1e-4


def _config(input_layout):
    import modelopt_moe.quantization as mtq

    cfg = mtq.load_config("fp8_default.yaml").model_dump()
    cfg["weight_amax_update"], cfg["input_amax_update"] = "static", "learned"
    cfg["experts"] = {"weight_amax": "vectorized", "input_amax": input_layout}
    return cfg


def _quantized(mm, kind, input_layout, calib, dtype):
    import modelopt_moe.quantization as mtq

    model = mm.build_moe_gpt(num_experts=EXPERTS, seed=SEED, experts=kind, params_dtype=dtype)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, _config(input_layout), lambda m: [mm.lm_loss(m, b) for b in calib])
    return model.train()


def _learned_inputs(model, mm, grad: bool) -> dict:
    """{dense quantizer name or (layer, gemm, global expert): learned input amax (or its reduced gradient)}, the
    union over ranks (a key several ranks hold must hold the same bits)."""
    ep_rank = mm.parallel_layout()["ep_rank"]
    local = {}
    for name, p in model.named_parameters():
        if not name.endswith("input_quantizer._amax"):
            continue
        value = (p.main_grad if grad else p).detach().float().clone()
        if ".mlp.experts." in name:
            layer, gemm = int(name.split("layers.")[1].split(".")[0]), name.split(".")[-3]
            for i in range(value.numel()):
                local[(layer, gemm, ep_rank * value.numel() + i)] = value[i].reshape(())
        else:
            local[name] = value
    return _gather_union(local)


def _layouts(mm, mt, calib, train):
    from modelopt_moe.plugins.megatron_cpu import megatron_training_shims

    out = {}
    for tp, ep in LAYOUTS:
        mm.init_model_parallel(tp, ep, seed=SEED)
        for kind, layout in CASES:
            model = _quantized(mm, kind, layout, calib, torch.float32)
            start = _learned_inputs(model, mm, grad=False)
            trainer = mt.setup_training(model, bf16=False, use_distributed_optimizer=False, lr=LR)
            grads = []

            def capture(model=model, grads=grads):
                with megatron_training_shims():
                    grads.append(_learned_inputs(model, mm, grad=True))

            for step in range(STEPS):
                mt.train_step(trainer, train[2 * step:2 * step + 2], step=step, after_backward=capture)
            end = _learned_inputs(model, mm, grad=False)
            out[(tp, ep, kind, layout)] = {"start": start, "grads": grads, "end": end}
        mm.destroy_model_parallel()
    return out


def _bf16_distributed(mm, mt, calib, train, ckpt):
    from modelopt_moe.distill import QADRecipe
    from modelopt_moe.plugins import megatron as mc
    from modelopt_moe.quantization.conversion import named_quantizers

    mm.init_model_parallel(2, 2, seed=SEED)
    model = _quantized(mm, "grouped", "shared", calib, torch.bfloat16)
    amaxes = {n: p for n, p in model.named_parameters() if n.endswith("input_quantizer._amax")}
    start = _learned_inputs(model, mm, grad=False)
    trainer = mt.setup_training(model, lr=1e-2, use_distributed_optimizer=True)
    losses = mt.train(trainer, train, steps=3, num_microbatches=2)
    end = _learned_inputs(model, mm, grad=False)  # asserts the replicas are equal
    mc.save_sharded_checkpoint([trainer.model], ckpt)
    mm.destroy_model_parallel()
    mm.init_model_parallel(1, 4, seed=SEED)  # resharded into a freshly built model
    fresh = mm.build_moe_gpt(num_experts=EXPERTS, seed=SEED + 1, experts="grouped", params_dtype=torch.bfloat16)
    mc.load_sharded_checkpoint([fresh], ckpt)
    restored = _learned_inputs(fresh, mm, grad=False)
    learned = all(q.learns_amax for n, q, _ in named_quantizers(fresh)
                  if n.endswith("input_quantizer") and q.is_enabled)
    # the QAD recipe's optimizer: the learned amaxes in their own groups at amax_lr_mult x the learning rate
    recipe = QADRecipe(input_amax_update="learned", amax_lr_mult=100.0)
    amax_ids = {id(p) for n, p in fresh.named_parameters() if n.endswith("_amax")}
    trainer = mt.setup_training(fresh, recipe=recipe, lr_decay_steps=4, use_distributed_optimizer=False)
    groups = [g for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
              for g in opt.param_groups]
    lrs = {(any(id(p) in amax_ids for p in g["params"]), g["max_lr"], g["min_lr"], g.get("wd_mult", 1.0))
           for g in groups if g["params"]}
    mt.train(trainer, train, steps=1, num_microbatches=2)
    mm.destroy_model_parallel()
    return {"names": sorted(amaxes), "dtype": {str(p.dtype) for p in amaxes.values()},
            "restored_equal": set(restored) == set(end) and all(torch.equal(restored[k], end[k]) for k in end),
            "restored_learned": learned, "recipe_groups": lrs, "recipe_lr": (recipe.lr, recipe.min_lr),
            "moved": sum(not torch.equal(start[k], end[k]) for k in start), "count": len(start), "losses": losses}


def _export(mm, hf_dir, out_dir):
    """A Qwen3-MoE from a transformers checkpoint at TP=2 x EP=2, FP8 with learned per-expert input amaxes, one
    step on them, exported: the learned amaxes (union over ranks)."""
    import modelopt_moe.quantization as mtq
    from modelopt_moe.export import build_megatron_model, export_hf, import_hf

    mm.init_model_parallel(2, 2, seed=SEED)
    model = build_megatron_model(hf_dir)
    import_hf(model, hf_dir)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    causal = torch.ones(16, 16, dtype=torch.bool).triu(1)[None, None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, _config("per_expert"), lambda m: m(tokens, positions, causal))
    model.train()
    model(tokens, positions, causal).float().pow(2).mean().backward()
    with torch.no_grad():  # a step of sign descent: every learned amax moves off its calibrated value
        for name, p in model.named_parameters():
            if name.endswith("input_quantizer._amax"):
                p.mul_(1 - 0.05 * torch.where(p.grad > 0, 1.0, -1.0))
    amax = _learned_inputs(model, mm, grad=False)
    export_hf(model.eval(), out_dir, format="compressed-tensors", progress=False)
    mm.destroy_model_parallel()
    return amax


def _worker(rank, world_size, root, hf_dir):
    import megatron_harness.models as mm

    from modelopt_moe.plugins.megatron import training as mt

    calib = mm.text_batches(2, 32, 2)
    train = mm.text_batches(2, 32, 6, offset=100)
    return {"layouts": _layouts(mm, mt, calib, train),
            "bf16": _bf16_distributed(mm, mt, calib, train, f"{root}/ckpt"),
            "export": _export(mm, hf_dir, f"{root}/export")}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = tmp_path_factory.mktemp("learned_inputs")
    config = Qwen3MoeConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=EXPERTS, num_experts_per_tok=2,
                            moe_intermediate_size=32, max_position_embeddings=64)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(path / "hf")
    return path


@pytest.fixture(scope="module")
def results(root):
    return spawn(_worker, WORLD, args=(str(root), str(root / "hf")), timeout=seconds(900))


@pytest.mark.parametrize(("kind", "layout"), CASES)
def test_learned_input_amax_gradients_and_values_do_not_depend_on_the_layout(results, kind, layout):
    runs = results[0]["layouts"]
    one, four = runs[(1, 1, kind, layout)], runs[(2, 2, kind, layout)]
    for key, a in one["start"].items():  # calibrated alike (up to the order of the sums)
        torch.testing.assert_close(four["start"][key], a, rtol=1e-5, atol=0)
    for step in range(STEPS):  # after Megatron's reduction: every entry, every step
        g1, g4 = one["grads"][step], four["grads"][step]
        assert set(g1) == set(g4)
        assert len(g1) > 8
        scale = max(g.abs().item() for g in g1.values())
        for key, g in g1.items():
            torch.testing.assert_close(g4[key], g, rtol=2e-3, atol=1e-3 * scale,
                                       msg=lambda m, key=key, step=step: f"step {step}, {key}: {m}")
        assert sum(bool(g != 0) for g in g1.values()) > len(g1) // 2
    moved = 0
    for key, a in one["end"].items():  # the optimizer's steps: the same to 1% of one step
        torch.testing.assert_close(four["end"][key] - four["start"][key], a - one["start"][key], rtol=0,
                                   atol=0.01 * LR, msg=lambda m, key=key: f"{key}: {m}")
        moved += not torch.equal(a, one["start"][key])
    assert moved == len(one["end"])
    if layout == "shared":  # one per layer: every expert's entry holds the same value
        for layer in (0, 1):
            for gemm in ("linear_fc1", "linear_fc2"):
                values = {one["end"][(layer, gemm, e)].item() for e in range(EXPERTS)}
                assert len(values) == 1, (layer, gemm, values)
    else:  # one per expert: they part
        assert len({one["end"][(0, "linear_fc2", e)].item() for e in range(EXPERTS)}) > 1


def test_bf16_distributed_optimizer_trains_fp32_learned_input_amaxes(results):
    for r in results:
        b = r["bf16"]
        assert b["names"]
        assert b["dtype"] == {"torch.float32"}
        assert b["moved"] > b["count"] // 2
        assert all(x == x for x in b["losses"])
        assert b["restored_equal"]  # saved at TP=2 x EP=2, loaded at TP=1 x EP=4: the same bits, by global expert
        assert b["restored_learned"]
        lr, min_lr = b["recipe_lr"]
        amax_groups = {g for g in b["recipe_groups"] if g[0]}
        assert amax_groups == {(True, 100 * lr, 100 * min_lr, 0.0)}, b["recipe_groups"]
        assert all(g[1:3] == (lr, min_lr) for g in b["recipe_groups"] - amax_groups), b["recipe_groups"]


def test_export_writes_the_learned_input_amax_as_input_scale(results, root):
    from safetensors.torch import load_file

    from modelopt_moe.export import codecs

    amax = results[0]["export"]
    tensors = {}
    for f in sorted((root / "export").glob("*.safetensors")):
        tensors.update(load_file(f))
    checked = 0
    for layer in range(2):
        p = f"model.layers.{layer}."
        dense = f"decoder.layers.{layer}.self_attention.linear_"
        linears = [(p + "self_attn." + m, amax[dense + "qkv.input_quantizer._amax"]) for m in ("q_proj", "k_proj",
                                                                                             "v_proj")]
        linears.append((p + "self_attn.o_proj", amax[dense + "proj.input_quantizer._amax"]))
        for e in range(EXPERTS):
            linears += [(f"{p}mlp.experts.{e}.{m}", amax[(layer, "linear_fc1", e)]) for m in ("gate_proj", "up_proj")]
            linears.append((f"{p}mlp.experts.{e}.down_proj", amax[(layer, "linear_fc2", e)]))
        for name, a in linears:
            assert tensors[f"{name}.input_scale"].item() == codecs.reciprocal(codecs.fp8_scale(a)).item(), name
            checked += 1
    assert checked == 2 * (4 + 3 * EXPERTS)
    assert len({amax[(0, "linear_fc2", e)].item() for e in range(EXPERTS)}) > 1  # per expert, learned apart
