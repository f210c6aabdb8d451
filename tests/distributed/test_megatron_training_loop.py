"""QAT through Megatron's real training machinery on 4 gloo ranks, then checkpoints restored in fresh processes.

The flow users run: build a Megatron MoE GPT (bf16), ``mtq.quantize`` it (FP8, vectorized expert weight amax), wrap
it in ``Float16Module`` + Megatron DDP, build ``get_megatron_optimizer`` (Adam, fp32 main params, distributed
optimizer) and train with ``get_forward_backward_func`` (2 micro-batches per step) at TP=2 x EP=2, 8 experts. After
training, the model's quantized forward must equal, bit for bit, that of a freshly built and quantized model given the
trained weights and every quantizer amax: a forward that still used pre-step weights anywhere (a stale cache) shows
up as a difference. Megatron's optimizers write parameters through ``.data`` and their parameter buffers, which does
not bump ``Tensor._version``.

Cases: SequentialMLP and grouped (TEGroupedMLP) experts with Megatron's own schedule (every micro-batch
re-quantizes), grouped experts with ``modelopt_moe.plugins.megatron.get_forward_backward_func`` (fake-quantized
weights reused across the micro-batches of a step: once per step), each beside its twin that differs only in
re-quantizing (the same optimizer, distributed or not: the two sum the clip norm in different orders), with which it
must train bit-identically, and a control: grouped experts with fp32 parameters and Megatron's non-distributed FP32
optimizer.

The checkpoint runs use Megatron's non-distributed optimizers (Float16 with fp32 main parameters; FP32); the
distributed optimizer's resume (torch's Adam on this machine) is tested through the README's flow in test_readme.py,
with TE's fused Adam in tests/gpu.

Then, in FRESH processes (nothing imported or registered by the training processes): the trained model saved with
each documented checkpoint call (``save_sharded_checkpoint`` with the optimizer state; the README's own
``dist_checkpointing`` calls plus ``save/restore_sharded_modelopt_state``) is restored at TP=1 x EP=4 into a freshly
built model, bit-exact in every weight and amax, with the logits, bit for bit, of a model built at TP=1 x EP=4 in the
same processes and given the saved weights and amaxes directly (the saved TP=2 x EP=2 logits are no reference: another
layout sums in another order, and in bf16 that moves fake-quant bins and routing), and trains on; and an fp32 run
saved after 2 of 4 steps (weights, amax, quantization, optimizer, LR scheduler, iteration) resumes at its own layout
and continues bit-identically to the uninterrupted run.
"""

import math
import os
import traceback
import zlib

import pytest
import torch
from limits import seconds  # noqa: E402
from test_checkpoint_reshard import assign_amax, global_amax, global_params  # noqa: E402 - sibling test module

from modelopt_moe.launch import spawn
from modelopt_moe.plugins.megatron_cpu import megatron_training_shims

WORLD, TP, EP, EXPERTS, SEED = 4, 2, 2, 8, 1234
KINDS = ("sequential", "grouped")
# case -> (experts, bf16 params + Float16Module, distributed optimizer, reuse fake-quantized weights within a step)
CASES = {
    "sequential": ("sequential", True, True, False),
    "grouped": ("grouped", True, True, False),
    "grouped_reuse": ("grouped", True, True, True),
    "grouped_local_optimizer": ("grouped", True, False, False),  # Megatron's Float16 optimizer (module docstring)
    "grouped_reuse_local_optimizer": ("grouped", True, False, True),
    "grouped_fp32_local_optimizer": ("grouped", False, False, False),
}
# Each reusing case and the re-quantizing case it must train bit-identically to: the same optimizer. The distributed
# and the per-rank optimizers sum the squared gradients of the clip norm over different partitions, so their runs
# part in the last bits of the clip factor and, a few steps later, in a bf16 rounding of a weight.
REUSE_TWINS = {"grouped_reuse": "grouped", "grouped_reuse_local_optimizer": "grouped_local_optimizer"}
SAVED_CASE = "grouped_reuse_local_optimizer"  # the trained model the checkpoint phase saves
RESUME_STEPS = 2  # the resume run saves after this many of 2 * RESUME_STEPS steps
STEPS, MICROBATCHES = 5, 2
BATCH, SEQ = 2, 32
EMBEDDING = "embedding.word_embeddings.weight"
# build_moe_gpt overrides under which both expert kinds must build the same model
VARIANTS = {"default": {}, "glu_bias": {"gated_linear_unit": True, "add_bias_linear": True}}


def _config(mtq):
    cfg = mtq.load_config("fp8_default.yaml")
    cfg.experts.weight_amax = "vectorized"
    # Calibrated amaxes, as this module's checkpoint comparisons expect; the dynamic default trains exactly too
    # (tests/distributed/test_amax_update_autoswitch_megatron.py).
    cfg.weight_amax_update = "static"
    return cfg


def _quantize(model, batches, mtq, mm):
    model.eval()
    mtq.quantize(model, _config(mtq), lambda m: [mm.lm_loss(m, b) for b in batches])
    model.train()
    return model


def _amax_buffers(module):
    return {n: b for n, b in module.named_buffers() if n.rsplit(".", 1)[-1] == "_amax"}


class _CountWeightQuantization:
    """Counts how often the grouped experts fake-quantize their weights (a reuse within a step does not count)."""

    def __enter__(self):
        from modelopt_moe.quantization.nn import expert_weights

        self.module, self.real, self.calls = expert_weights, expert_weights.reused_or_computed, 0

        def counting(module, key, compute):
            def counted():
                self.calls += 1
                return compute()
            return self.real(module, key, counted)

        expert_weights.reused_or_computed = counting
        return self

    def __exit__(self, *exc):
        self.module.reused_or_computed = self.real


def _train_and_compare(case, calib, train_batches, eval_batch, root):
    import megatron_harness.models as mm
    from megatron.core.transformer.module import Float16Module

    import modelopt_moe.quantization as mtq
    from modelopt_moe.plugins.megatron import training as mt

    kind, bf16, distributed, reuse = CASES[case]
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = _quantize(mm.build_moe_gpt(num_experts=EXPERTS, seed=SEED, experts=kind, params_dtype=dtype),
                      calib, mtq, mm)
    initial = {n: p.detach().clone() for n, p in mm.iter_params_with_global_names(model)}
    trainer = mt.setup_training(model, bf16=bf16, use_distributed_optimizer=distributed,
                                reuse_quantized_weights=reuse)
    grad_norms = []
    optimizer_step = trainer.optimizer.step

    def step_recording_the_grad_norm():
        result = optimizer_step()
        grad_norms.append(float(result[1]))  # (update successful, grad norm, zeros)
        return result

    trainer.optimizer.step = step_recording_the_grad_norm
    with _CountWeightQuantization() as count:
        losses = mt.train(trainer, train_batches, steps=STEPS, num_microbatches=MICROBATCHES)
    trainer.optimizer.step = optimizer_step
    params = {n: p.detach().clone() for n, p in mm.iter_params_with_global_names(mt.unwrap(trainer.model))}
    changed = {n: not torch.equal(initial[n], p) for n, p in params.items()}
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
    assert src_amax.keys() == dst_amax.keys()
    assert src_amax
    with torch.no_grad():
        for name, p in dst_params.items():
            p.copy_(src_params[name])
        for name, a in dst_amax.items():
            a.copy_(src_amax[name])
    fresh.eval()
    with torch.no_grad():
        fresh_logits = mm.gather_logits(fresh, eval_batch)
    out = {
        "losses": losses,
        "grad_norms": grad_norms,
        "params": params,
        "changed": changed,
        "equal": torch.equal(trained_logits, fresh_logits),
        "max_abs_diff": (trained_logits.float() - fresh_logits.float()).abs().max().item(),
        "num_amax": len(src_amax),
        "weight_quantizations": count.calls,
    }
    if case == SAVED_CASE:
        out["saved"] = _save_both_ways(trainer, eval_batch, root)
    return out


def _built_from(saved):
    """A model built and quantized at the current layout, given ``saved``'s global weights and amaxes directly (no
    checkpoint involved) and wrapped in ``Float16Module`` as training wraps it."""
    import megatron_harness.models as mm
    from megatron.core import parallel_state
    from megatron.core.transformer.module import Float16Module

    import modelopt_moe.quantization as mtq

    model = mm.build_moe_gpt(num_experts=EXPERTS, seed=SEED + 11, experts="grouped", params_dtype=torch.bfloat16)
    mtq.quantize(model, _config(mtq))
    assign_amax(model, mm, saved["amax"])
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in mm.iter_params_with_global_names(model):
            full = saved["params"][name]
            if tp > 1 and getattr(p, "tensor_model_parallel", False) and getattr(p, "allreduce", True):
                full = full.chunk(tp, dim=p.partition_dim)[tp_rank]  # the inverse of global_params
            p.copy_(full)
    return Float16Module(model.config, model).eval()


def _save_both_ways(trainer, eval_batch, root):
    """Saves the trained model with each documented checkpoint call; returns what a restore must reproduce."""
    import megatron_harness.models as mm
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from modelopt_moe.checkpoint import save_sharded_modelopt_state
    from modelopt_moe.plugins.megatron import save_sharded_checkpoint
    from modelopt_moe.plugins.megatron import training as mt

    with megatron_training_shims():  # the optimizer's checkpoint code moves tensors with .cuda()
        save_sharded_checkpoint([trainer.model], os.path.join(root, "api"), optimizer=trainer.optimizer,
                                iteration=STEPS, extra_state={"data_offset": 100 + STEPS * MICROBATCHES})
    readme = os.path.join(root, "readme")  # the README's flow with the user's own Megatron calls
    if dist.get_rank() == 0:
        os.makedirs(readme)
    dist.barrier()
    model = mt.unwrap(trainer.model)  # as Megatron-LM checkpoints it: without DDP / Float16Module
    dist_checkpointing.save({"model": model.sharded_state_dict()}, readme)
    save_sharded_modelopt_state([model], readme)
    dist.barrier()
    model = mt.unwrap(trainer.model)
    with torch.no_grad():
        logits = mm.gather_logits(trainer.model.eval(), eval_batch)
    saved = {"amax": global_amax(model, mm), "params": global_params(model, mm), "logits": logits}
    with torch.no_grad():  # what the restore compares against, built at this layout: the trained model's logits
        saved["built_here_equal"] = torch.equal(mm.gather_logits(_built_from(saved), eval_batch), logits)
    return saved


def _resume_run(calib, train_batches, root, restore_from=None):
    """fp32 grouped experts, distributed optimizer, cosine LR: 2 * RESUME_STEPS steps, saving after RESUME_STEPS;
    or, with ``restore_from``, a fresh model that loads that checkpoint and runs the remaining steps."""
    import megatron_harness.models as mm

    import modelopt_moe.quantization as mtq
    from modelopt_moe.checkpoint import restore_sharded_modelopt_state
    from modelopt_moe.plugins.megatron import load_sharded_checkpoint, save_sharded_checkpoint
    from modelopt_moe.plugins.megatron import training as mt

    seed = SEED if restore_from is None else SEED + 99  # the resumed model must get everything from the checkpoint
    model = mm.build_moe_gpt(num_experts=EXPERTS, seed=seed, experts="grouped")
    if restore_from is None:
        _quantize(model, calib, mtq, mm)
    else:
        restore_sharded_modelopt_state([model], restore_from)  # quantize like the checkpoint, before wrapping
    trainer = mt.setup_training(model, bf16=False, use_distributed_optimizer=False, lr_decay_steps=2 * RESUME_STEPS,
                                reuse_quantized_weights=True)
    losses = []
    if restore_from is None:
        losses += mt.train(trainer, train_batches, steps=RESUME_STEPS, num_microbatches=MICROBATCHES)
        with megatron_training_shims():
            save_sharded_checkpoint([trainer.model], os.path.join(root, "resume"), optimizer=trainer.optimizer,
                                    opt_param_scheduler=trainer.scheduler, iteration=RESUME_STEPS)
        start = RESUME_STEPS
    else:
        with megatron_training_shims():
            state = load_sharded_checkpoint([trainer.model], restore_from, optimizer=trainer.optimizer,
                                            opt_param_scheduler=trainer.scheduler)
        start = state["iteration"]
    losses += mt.train(trainer, train_batches, steps=2 * RESUME_STEPS - start, num_microbatches=MICROBATCHES,
                       start_step=start)
    return {"losses": losses, "start": start, "params": global_params(mt.unwrap(trainer.model), mm),
            "lr": trainer.optimizer.param_groups[0]["lr"]}


def _same_model_both_kinds(eval_batch, calib, **overrides):
    """Sequential and grouped experts built from one seed (fp32): same weights, logits, gradients and checkpoint keys,
    before and after quantization."""
    import megatron_harness.models as mm

    import modelopt_moe.quantization as mtq

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
    from modelopt_moe.plugins.megatron_cpu import megatron_training_shims

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


def _train_worker(rank, world_size, root):
    import megatron_harness.models as mm

    out_shims = _shim_checks()
    mm.init_model_parallel(TP, EP, seed=SEED)
    calib = mm.text_batches(BATCH, SEQ, 2)
    train_batches = mm.text_batches(BATCH, SEQ, STEPS * MICROBATCHES, offset=100)
    eval_batch = mm.text_batches(BATCH, SEQ, 1, offset=1000)[0]
    out = {"shims": out_shims, "layout": mm.parallel_layout(),
           "same_model": {name: _same_model_both_kinds(eval_batch, calib, **over) for name, over in VARIANTS.items()}}
    for case in CASES:
        try:
            out[case] = _train_and_compare(case, calib, train_batches, eval_batch, root)
        except Exception:  # reported by that case's tests; the other cases still run
            out[case] = {"error": traceback.format_exc()}
    out["resume"] = _resume_run(calib, train_batches, root)
    mm.destroy_model_parallel()
    return out


def _restore_and_train_on(flow, root, eval_batch, train_batches, saved):
    """At TP=1 x EP=4, a freshly built model restored through one documented call, then two training steps; and the
    logits of ``saved`` (the trained weights and amaxes) given directly to a model built at this layout."""
    import megatron_harness.models as mm
    from megatron.core import dist_checkpointing

    from modelopt_moe.checkpoint import restore_sharded_modelopt_state
    from modelopt_moe.plugins.megatron import load_sharded_checkpoint
    from modelopt_moe.plugins.megatron import training as mt

    model = mm.build_moe_gpt(num_experts=EXPERTS, seed=SEED + 7, experts="grouped", params_dtype=torch.bfloat16)
    ckpt = os.path.join(root, flow)
    restore_sharded_modelopt_state([model], ckpt)  # converts the fresh model like the checkpoint's, before wrapping
    trainer = mt.setup_training(model, use_distributed_optimizer=False, reuse_quantized_weights=True)
    info = {}
    if flow == "api":
        with megatron_training_shims():
            info = load_sharded_checkpoint([trainer.model], ckpt, optimizer=trainer.optimizer)
    else:
        bare = mt.unwrap(trainer.model)
        bare.load_state_dict(dist_checkpointing.load({"model": bare.sharded_state_dict()}, ckpt)["model"])
    model = mt.unwrap(trainer.model)
    out = {"info": info, "amax": global_amax(model, mm), "params": global_params(model, mm)}
    with torch.no_grad():
        out["logits"] = mm.gather_logits(trainer.model.eval(), eval_batch)
        out["built_here_logits"] = mm.gather_logits(_built_from(saved), eval_batch)
    out["losses"] = mt.train(trainer, train_batches, steps=2, num_microbatches=MICROBATCHES)
    return out


def _restore_worker(rank, world_size, root, saved):
    import megatron_harness.models as mm

    calib = mm.text_batches(BATCH, SEQ, 2)
    train_batches = mm.text_batches(BATCH, SEQ, STEPS * MICROBATCHES, offset=100)
    eval_batch = mm.text_batches(BATCH, SEQ, 1, offset=1000)[0]
    out = {}
    mm.init_model_parallel(TP, EP, seed=SEED)
    out["resume"] = _resume_run(calib, train_batches, root, restore_from=os.path.join(root, "resume"))
    mm.init_model_parallel(1, 4, seed=SEED)
    out["layout"] = mm.parallel_layout()
    for flow in ("api", "readme"):
        try:
            out[flow] = _restore_and_train_on(flow, root, eval_batch, train_batches, saved)
        except Exception:
            out[flow] = {"error": traceback.format_exc()}
    mm.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("training_loop"))


@pytest.fixture(scope="module")
def results(root):
    return spawn(_train_worker, WORLD, args=(root,), timeout=seconds(900))


@pytest.fixture(scope="module")
def restored(results, root):
    saved = {k: v for k, v in _case(results, SAVED_CASE)[0]["saved"].items() if k in ("amax", "params")}
    return spawn(_restore_worker, WORLD, args=(root, saved), timeout=seconds(900))  # fresh processes


def _case(results, case):
    for r in results:
        if "error" in r[case]:
            raise RuntimeError(f"{case} case failed on a rank:\n{r[case]['error']}")
    return [r[case] for r in results]


def test_layout(results):
    assert [r["layout"]["tp"] for r in results] == [TP] * WORLD
    assert [r["layout"]["ep"] for r in results] == [EP] * WORLD


def test_training_shims_map_cuda_to_cpu_and_restore(results):
    for r in results:
        s = r["shims"]
        assert s["active"]
        assert s["factory_device"] == "cpu"
        assert s["tensor_device"] == "cpu"
        assert s["cuda_is_identity"]
        assert s["stream_waits"]
        assert s["restored"]
        assert s["type"] == ("torch.cuda.BFloat16Tensor", "torch.cuda.FloatTensor", torch.float32)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_grouped_and_sequential_experts_build_the_same_model(results, variant):
    for r in results:
        s = r["same_model"][variant]
        assert s["param_names_equal"]
        assert s["params_equal"]
        assert s["logits_equal"]
        assert s["quant_logits_equal"]
        assert s["quant_grads_equal"]
        assert s["sharded_keys_equal"]
        assert s["quant_sharded_keys_equal"]
        assert s["grouped_quantized_class"] == "QuantMegatronColumnParallelGroupedLinear"


@pytest.mark.parametrize("case", list(CASES))
def test_training_runs_and_updates_every_weight(results, case):
    cases = _case(results, case)
    for c in cases:
        assert len(c["losses"]) == STEPS, c["losses"]
        assert all(math.isfinite(x) for x in c["losses"]), c["losses"]
        assert c["losses"][-1] < c["losses"][0], c["losses"]
        assert c["losses"] == cases[0]["losses"]  # the vocab-parallel loss is the same on every rank
        experts = [n for n in c["changed"] if ".local_experts." in n]
        assert len(experts) == 2 * 2 * EXPERTS // EP  # layers x gemms x local experts
        # The vocab-parallel embedding shard of token ids >= 128 sees no token of the ASCII text: no gradient there.
        unchanged = [n for n, ch in c["changed"].items() if not ch and n != EMBEDDING]
        assert not unchanged, unchanged
    assert any(c["changed"][EMBEDDING] for c in cases)


@pytest.mark.parametrize("case", list(CASES))
def test_trained_forward_equals_a_fresh_model_with_the_trained_weights(results, case):
    cases = _case(results, case)
    diffs = [c["max_abs_diff"] for c in cases]
    assert all(c["equal"] for c in cases), f"{case}: max |d logits| per rank {diffs}"


@pytest.mark.parametrize("reuse_case", list(REUSE_TWINS))
def test_grouped_weights_are_quantized_every_micro_batch_or_once_per_step_with_reuse(results, reuse_case):
    gemms = 2 * 2  # layers x (fc1, fc2)
    twin = REUSE_TWINS[reuse_case]
    assert CASES[reuse_case][:3] == CASES[twin][:3]
    assert CASES[reuse_case][3]
    assert not CASES[twin][3]
    for r in _case(results, twin):
        assert r["weight_quantizations"] == STEPS * MICROBATCHES * gemms
    for r in _case(results, reuse_case):
        assert r["weight_quantizations"] == STEPS * gemms
    # and the reusing run trained exactly like the re-quantizing one: the same gradients (their clip norm) at every
    # step, the same losses, the same trained weights
    for reused, requantized in zip(_case(results, reuse_case), _case(results, twin), strict=True):
        assert reused["grad_norms"] == requantized["grad_norms"]
        assert reused["losses"] == requantized["losses"]
        _assert_same(reused["params"], requantized["params"], f"{reuse_case} vs {twin} trained params")


def _assert_same(got: dict, want: dict, what: str):
    assert got.keys() == want.keys(), what
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {bad[:5]}"


@pytest.mark.parametrize("flow", ["api", "readme"])
def test_restored_at_tp1_ep4_in_fresh_processes_is_bit_exact_and_trains_on(results, restored, flow):
    saved = _case(results, SAVED_CASE)[0]["saved"]
    for r in restored:
        assert r["layout"]["tp"] == 1
        assert r["layout"]["ep"] == 4
        got = r[flow]
        assert "error" not in got, got.get("error")
        _assert_same(got["amax"], saved["amax"], f"{flow} amax")
        _assert_same(got["params"], saved["params"], f"{flow} params")
        # The saved weights and amaxes given directly to a model built at TP=1 x EP=4 (which at TP=2 x EP=2 gives the
        # saved logits bit for bit): the restored model computes exactly what they define at this layout.
        assert saved["built_here_equal"]
        assert torch.equal(got["logits"], got["built_here_logits"]), \
            (got["logits"].float() - got["built_here_logits"].float()).abs().max().item()
        assert len(got["losses"]) == 2
        assert all(math.isfinite(x) for x in got["losses"])
        if flow == "api":
            assert got["info"] == {"iteration": STEPS, "extra_state": {"data_offset": 100 + STEPS * MICROBATCHES}}


def test_resume_continues_bit_identically_to_the_uninterrupted_run(results, restored):
    for r, s in zip(results, restored, strict=True):
        full, resumed = r["resume"], s["resume"]
        assert resumed["start"] == RESUME_STEPS
        assert resumed["losses"] == full["losses"][RESUME_STEPS:]
        assert resumed["lr"] == full["lr"]
        _assert_same(resumed["params"], full["params"], "resumed params")
