"""Weight amax updates and precision autoswitch in Megatron's training machinery on 4 gloo ranks (TP=2 x EP=2, one
spawn for the module).

* ``dynamic``: after steps of Megatron's optimizer (which writes weights through ``.data``), every quantized weight
  (attention, TP-sharded, max-reduced over TP; experts of both kinds) is quantized with the amax of its current
  weights: the trained model's logits equal, bit for bit, those of a fresh model given the trained weights only, and
  a TP-sharded weight's amax is the max over its shards on every TP rank.
* ``learned``: the amaxes are parameters that Megatron's optimizer trains, and TP replicas stay equal (their gradient
  is summed over TP).
* autoswitch through ``get_forward_backward_func`` (each call one step): a planted outlier expert switches its fc1
  fprop to high precision in every sampled step while the other experts stay quantized; one log per rank; the summary
  reads them all.
"""

import warnings

import pytest
import torch
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn

WORLD, TP, EP, EXPERTS, SEED = 4, 2, 2, 4, 1234
OUTLIER = 1  # global expert index (local expert 1 on EP rank 0)


def _config(update, autoswitch=None, experts_only=False):
    from megatron_harness.configs import expert_quant_config

    if experts_only:
        cfg = expert_quant_config("fp8", update)
    else:
        import modelopt_moe.quantization as mtq

        cfg = mtq.load_config("fp8_default.yaml").model_dump()
        cfg["weight_amax_update"] = update
        cfg["experts"]["weight_amax"] = "vectorized"
    if autoswitch:
        cfg["autoswitch"] = autoswitch
    return cfg


def _quantized(mm, kind, cfg, calib, dtype=torch.bfloat16, model=None):
    import modelopt_moe.quantization as mtq

    model = model or mm.build_moe_gpt(num_experts=EXPERTS, seed=SEED, experts=kind, params_dtype=dtype)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, cfg, lambda m: [mm.lm_loss(m, b) for b in calib])
    return model.train()


def _dynamic(mm, mt, kind, calib, train, eval_batch):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.module import Float16Module

    model = _quantized(mm, kind, _config("dynamic"), calib)
    trainer = mt.setup_training(model, lr=1e-2, reuse_quantized_weights=True)
    mt.train(trainer, train, steps=3, num_microbatches=2)
    trained = mt.unwrap(trainer.model)
    with torch.no_grad():
        logits = mm.gather_logits(trainer.model.eval(), eval_batch)
    fresh = Float16Module(trained.config, _quantized(mm, kind, _config("dynamic"), calib))
    with torch.no_grad():
        for (n, p), (m, q) in zip(fresh.module.named_parameters(), trained.named_parameters(), strict=True):
            assert n == m
            p.copy_(q)
        fresh_logits = mm.gather_logits(fresh.eval(), eval_batch)
    qkv = trained.decoder.layers[0].self_attention.linear_qkv
    local = qkv.weight.detach().float().abs().amax()
    full = local.clone()
    dist.all_reduce(full, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    return {"equal": torch.equal(logits, fresh_logits), "qkv_amax": qkv.weight_quantizer.amax.item(),
            "qkv_full_max": full.item(), "qkv_local_max": local.item()}


def _learned(mm, mt, calib, train):
    import torch.distributed as dist
    from megatron.core import parallel_state

    model = _quantized(mm, "grouped", _config("learned"), calib)
    amaxes = {n: p for n, p in model.named_parameters() if n.endswith("_amax")}
    before = {n: p.detach().clone() for n, p in amaxes.items()}
    trainer = mt.setup_training(model, lr=1e-2, use_distributed_optimizer=False)
    opt_ids = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    mt.train(trainer, train, steps=3, num_microbatches=2)
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight_quantizer.amax.detach().clone()
    replicas = [torch.zeros_like(qkv) for _ in range(TP)]
    dist.all_gather(replicas, qkv, group=parallel_state.get_tensor_model_parallel_group())
    return {"names": sorted(amaxes), "in_optimizer": all(id(p) in opt_ids or id(getattr(p, "main_param", p)) in opt_ids
                                                         for p in amaxes.values()),
            "changed": sum(not torch.equal(p.detach(), before[n]) for n, p in amaxes.items()),
            "dtype": {str(p.dtype) for p in amaxes.values()}, "qkv_replicas": [r.item() for r in replicas]}


def _autoswitch(mm, mt, kind, calib, train, log_dir):
    from megatron.core import parallel_state

    auto = {"every": 2, "underflow_pct": 50.0, "gemms": ["fprop"], "log_dir": log_dir}
    model = mm.build_moe_gpt(num_experts=EXPERTS, seed=SEED, experts=kind, params_dtype=torch.bfloat16)
    n_local, ep_rank = EXPERTS // EP, parallel_state.get_expert_model_parallel_rank()
    if ep_rank == OUTLIER // n_local:  # a heavy tail: one weight 1e5 times every other
        for layer in model.decoder.layers:
            experts = layer.mlp.experts
            w = (experts.local_experts[OUTLIER % n_local].linear_fc1.weight if kind == "sequential"
                 else getattr(experts.linear_fc1, f"weight{OUTLIER % n_local}"))
            with torch.no_grad():
                w.mul_(1e-6)
                w[0, 0] = 0.1
    model = _quantized(mm, kind, _config("static", auto, experts_only=True), calib, model=model)
    # A tiny lr: Adam would otherwise lift the planted tiny weights out of the underflow within a step.
    trainer = mt.setup_training(model, lr=1e-9, autoswitch=True)
    losses = mt.train(trainer, train, steps=3, num_microbatches=2)  # steps 0, 1, 2: 0 and 2 are sampled
    return {"losses": losses}


def _worker(rank, world_size, root):
    import megatron_harness.models as mm

    from modelopt_moe.plugins.megatron import training as mt

    mm.init_model_parallel(TP, EP, seed=SEED)
    calib = mm.text_batches(2, 32, 2)
    train = mm.text_batches(2, 32, 6, offset=100)
    eval_batch = mm.text_batches(2, 32, 1, offset=1000)[0]
    out = {kind: _dynamic(mm, mt, kind, calib, train, eval_batch) for kind in ("sequential", "grouped")}
    out["learned"] = _learned(mm, mt, calib, train)
    for kind in ("sequential", "grouped"):
        out[f"autoswitch_{kind}"] = _autoswitch(mm, mt, kind, calib, train, f"{root}/{kind}")
    mm.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("amax_autoswitch"))


@pytest.fixture(scope="module")
def results(root):
    return spawn(_worker, WORLD, args=(root,), timeout=seconds(900))


@pytest.mark.parametrize("kind", ["sequential", "grouped"])
def test_dynamic_amax_follows_the_trained_weights_exactly(results, kind):
    for r in results:
        d = r[kind]
        assert d["equal"], kind
        assert d["qkv_amax"] == d["qkv_full_max"] >= d["qkv_local_max"]  # max over the TP shards
    assert any(r[kind]["qkv_amax"] > r[kind]["qkv_local_max"] for r in results)  # the reduction mattered somewhere


def test_learned_amax_trains_and_tp_replicas_stay_equal(results):
    for r in results:
        ln = r["learned"]
        assert ln["names"]
        assert all(n.endswith("weight_quantizer._amax") for n in ln["names"])
        assert ln["in_optimizer"]
        assert ln["changed"] == len(ln["names"])
        assert ln["dtype"] == {"torch.float32"}  # kept fp32 inside Float16Module
        assert ln["qkv_replicas"][0] == ln["qkv_replicas"][1]


@pytest.mark.parametrize("kind", ["sequential", "grouped"])
def test_outlier_expert_switches_its_fprop_and_the_others_stay_quantized(results, root, kind):
    import modelopt_moe.quantization as mtq
    from modelopt_moe.quantization.autoswitch import log_file

    assert all(log_file(f"{root}/{kind}", r).is_file() for r in range(WORLD))
    rows = mtq.autoswitch_summary(f"{root}/{kind}")
    fc1 = [r for r in rows if r["layer"].endswith("mlp.experts.linear_fc1")]
    assert {r["expert"] for r in fc1} == set(range(EXPERTS))
    assert all(r["steps"] == [0, 2] for r in fc1)
    for r in fc1:
        if r["expert"] == OUTLIER:
            assert r["switched"] == r["samples"] > 0, r
        else:
            assert r["switched"] == 0, r
    for r in results:
        assert all(x == x for x in r[f"autoswitch_{kind}"]["losses"])  # finite
