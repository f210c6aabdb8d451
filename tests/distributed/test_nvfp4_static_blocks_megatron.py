"""Static NVFP4 block scales on a Megatron MoE GPT split over ranks (4 gloo ranks, one spawn): the FP8 scale sweep
at TP=2 x EP=2, saved with ``save_sharded_checkpoint`` and loaded at TP=1 x EP=1 and TP=1 x EP=4 into a model of other
weights, gives every block amax (dense linears split over TP, every expert by its global index) bit for bit as the
sweep on one TP=1 x EP=1 model, and the same logits; ``export_hf`` at TP=2 x EP=2 writes the same files as at TP=1 x
EP=1, whose every exported weight row is a row of the fake-quantized weights (and some are not rows of dynamic
NVFP4's); for SequentialMLP and grouped experts, which with the same weights choose the same block amaxes.
SequentialMLP experts also at expert-TP 2 (the block amaxes split with the weight): a sweep at EP=2 x ETP=2 gives the
same block amaxes, its checkpoint loads at ETP=1 and the ETP=1 checkpoint loads at ETP=2, bit for bit, with the same
logits. With ``weight_amax_update: learned`` Megatron's training (bf16, distributed optimizer) trains every block
amax, kept fp32, and a checkpoint carries the trained values."""

import os

import torch
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn

KINDS = ("sequential", "grouped")
LOADS = ((1, 1), (1, 4))
CONFIG = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                        {"quantizer_name": "*weight_quantizer", "cfg": {
                            "num_bits": (2, 1), "block_sizes": {-1: 16, "type": "static", "scale_bits": (4, 3)}}}],
          "algorithm": {"method": "mse", "fp8_scale_sweep": True}, "weight_amax_update": "static"}


def _block_amaxes(model, mm) -> dict:
    """Every block amax of this rank, layout-free: dense ones whole (gathered over TP on their split axis), expert
    ones by (name, global expert)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from modelopt_moe.quantization import ExpertQuantizer, named_quantizers

    tp = parallel_state.get_tensor_model_parallel_group()
    tp_size = dist.get_world_size(tp)
    etp = parallel_state.get_expert_tensor_parallel_group()
    etp_size = dist.get_world_size(etp)
    out = {}
    for name, q, module in named_quantizers(model):
        if not name.endswith("weight_quantizer") or q.block_amax is None:
            continue
        if isinstance(q, ExpertQuantizer):
            blocks = q.block_amax
            if etp_size > 1:  # whole experts: fc1 by rows (gate rows then up rows), fc2 by K
                parts = [torch.empty_like(blocks) for _ in range(etp_size)]
                dist.all_gather(parts, blocks.contiguous(), group=etp)
                if "linear_fc1" in name:
                    halves = [p.chunk(2, dim=1) for p in parts]
                    blocks = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=1)
                else:
                    blocks = torch.cat(parts, dim=2)
            ep_rank = parallel_state.get_expert_model_parallel_rank()
            for i in range(q.num_experts):
                out[(name, ep_rank * q.num_experts + i)] = blocks[i].clone()
            continue
        parts = [torch.empty_like(q.block_amax) for _ in range(tp_size)]
        dist.all_gather(parts, q.block_amax.contiguous(), group=tp)
        out[name] = torch.cat(parts, dim=module.sharded_axis)
    return out


def _union(local: dict) -> dict:
    import torch.distributed as dist

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    out = {}
    for part in parts:
        for k, v in part.items():
            assert k not in out or torch.equal(out[k], v), f"ranks disagree on {k}"
            out[k] = v
    return out


def _fake_quant_rows(model, dynamic: bool = False) -> set:
    """The bytes of every row of every fake-quantized weight (with dynamic NVFP4 block scales instead: the
    weights' own block max)."""
    from modelopt_moe.numerics import fake_quant
    from modelopt_moe.quantization import ExpertQuantizer, named_quantizers
    from modelopt_moe.quantization.weight_operands import weight_operands

    rows = set()
    owners = {id(module) for _, _, module in named_quantizers(model)}
    for module in model.modules():
        if id(module) not in owners:
            continue
        for _, q, weights in weight_operands(module):
            if not q.is_enabled:
                continue
            for i, w in enumerate(weights):
                with torch.no_grad():
                    if dynamic:
                        amax = q.row_of(q.amax, i) if isinstance(q, ExpertQuantizer) else q.amax
                        fq = fake_quant(w.float(), "nvfp4", amax)
                    else:
                        fq = q.fake_quant_expert(i, w.float()) if isinstance(q, ExpertQuantizer) else q(w.float())
                rows.update(r.numpy().tobytes() for r in fq)
    return rows


def _exported_rows(path) -> tuple[dict, list]:
    """The exported tensors, and every row of every NVFP4 weight decoded with its stored scales."""
    import glob

    from safetensors.torch import load_file

    from modelopt_moe.export.codecs import decode_nvfp4_modelopt

    tensors = {}
    for file in sorted(glob.glob(f"{path}/*.safetensors")):
        tensors.update(load_file(file))
    rows = []
    for name, t in tensors.items():
        if name.endswith(".weight_scale_2"):
            module = name[: -len(".weight_scale_2")]
            w = decode_nvfp4_modelopt(tensors[module + ".weight"], tensors[module + ".weight_scale"], t,
                                      torch.float32)
            rows += [r.numpy().tobytes() for r in w]
    return tensors, rows


def _build(mm, kind: str, seed: int, etp: int = 1):
    import torch.nn.functional as F

    return mm.build_moe_gpt(num_layers=2, hidden=64, ffn_hidden=32, num_experts=4, vocab_size=128, seq_len=16,
                            experts=kind, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                            seed=seed, expert_tensor_parallel_size=etp).eval()


def _init_etp2(mm):
    """EP=2 x expert-TP=2 on the 4 ranks (TP=1)."""
    from megatron.core import parallel_state, tensor_parallel

    mm.init_model_parallel(1, 1, seed=1)  # the CPU shims and the RNG trackers
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2, expert_tensor_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1, inference_rng_tracker=True, force_reset_rng=True)


def _expert_tp(mm, root, calib, batch, results) -> None:
    """SequentialMLP experts at EP=2 x ETP=2: the sweep, its checkpoint at ETP=1, the ETP=1 checkpoint at ETP=2."""
    import modelopt_moe.quantization as mtq
    from modelopt_moe.plugins import megatron as mc

    kind = "sequential"
    _init_etp2(mm)
    model = _build(mm, kind, 3, etp=2)
    mtq.quantize(model, CONFIG, lambda m: mm.lm_loss(m, calib))
    with torch.no_grad():
        results[(kind, "etp2")] = (_union(_block_amaxes(model, mm)), mm.gather_logits(model, batch))
    mc.save_sharded_checkpoint([model], os.path.join(root, f"{kind}_etp2"))
    mm.destroy_model_parallel()
    mm.init_model_parallel(1, 1, seed=1)
    fresh = _build(mm, kind, 11)
    mc.load_sharded_checkpoint([fresh], os.path.join(root, f"{kind}_etp2"))
    with torch.no_grad():
        results[(kind, "etp2 at etp1")] = (_union(_block_amaxes(fresh, mm)), mm.gather_logits(fresh, batch))
    mm.destroy_model_parallel()
    _init_etp2(mm)
    fresh = _build(mm, kind, 11, etp=2)
    mc.load_sharded_checkpoint([fresh], os.path.join(root, kind))  # saved at TP=2 x EP=2, ETP=1
    with torch.no_grad():
        results[(kind, "etp1 at etp2")] = (_union(_block_amaxes(fresh, mm)), mm.gather_logits(fresh, batch))
    mm.destroy_model_parallel()


def _learned(mm, root) -> dict:
    """TP=2 x EP=2: learned block scales through Megatron's optimizer, then a checkpoint of the trained model."""
    import warnings

    import modelopt_moe.quantization as mtq
    from modelopt_moe.plugins import megatron as mc
    from modelopt_moe.plugins.megatron import training as mt

    mm.init_model_parallel(2, 2, seed=1)
    model = mm.build_moe_gpt(num_experts=4, seed=3, experts="grouped", params_dtype=torch.bfloat16).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, {**CONFIG, "weight_amax_update": "learned"},
                     lambda m: mm.lm_loss(m, mm.text_batches(2, 32, 1)[0]))
    blocks = {n: p for n, p in model.named_parameters() if n.endswith("_block_amax")}
    before = {n: p.detach().clone() for n, p in blocks.items()}
    trainer = mt.setup_training(model.train(), lr=1e-2)
    mt.train(trainer, mm.text_batches(2, 32, 4, offset=100), steps=2, num_microbatches=2)
    out = {"names": sorted(blocks), "changed": sum(not torch.equal(p.detach(), before[n]) for n, p in blocks.items()),
           "dtype": {str(p.dtype) for p in blocks.values()}, "trained": _union(_block_amaxes(model, mm))}
    mc.save_sharded_checkpoint([model], os.path.join(root, "learned"))
    mm.destroy_model_parallel()
    mm.init_model_parallel(1, 1, seed=1)
    fresh = mm.build_moe_gpt(num_experts=4, seed=11, experts="grouped", params_dtype=torch.bfloat16).eval()
    mc.load_sharded_checkpoint([fresh], os.path.join(root, "learned"))
    out["loaded"] = _union(_block_amaxes(fresh, mm))
    out["loaded_learns"] = all(q.learns_block_amax for n, q, _ in mtq.named_quantizers(fresh)
                               if n.endswith("weight_quantizer") and q.is_enabled)
    mm.destroy_model_parallel()
    return out


def _worker(rank, world_size, root):
    import megatron_harness.models as mm

    import modelopt_moe.quantization as mtq
    from modelopt_moe.export import export_hf
    from modelopt_moe.plugins import megatron as mc

    batches = mm.text_batches(2, 16, 3, vocab_size=128)
    calib, batch = batches[0], batches[2]
    results = {}
    for kind in KINDS:
        mm.init_model_parallel(1, 1, seed=1)
        model = _build(mm, kind, 3)
        maxed = _build(mm, kind, 3)
        mtq.quantize(model, CONFIG, lambda m: mm.lm_loss(m, calib))
        mtq.quantize(maxed, {**CONFIG, "algorithm": "max"}, lambda m: mm.lm_loss(m, calib))
        with torch.no_grad():
            results[(kind, "one rank")] = (_union(_block_amaxes(model, mm)), mm.gather_logits(model, batch))
        results[(kind, "max")] = (_union(_block_amaxes(maxed, mm)), None)
        export_hf(model, os.path.join(root, f"{kind}_one_rank"), format="modelopt", progress=False)
        if rank == 0:
            results[(kind, "rows")] = (_fake_quant_rows(model), _fake_quant_rows(model, dynamic=True))
        mm.destroy_model_parallel()

        mm.init_model_parallel(2, 2, seed=1)
        model = _build(mm, kind, 3)
        mtq.quantize(model, CONFIG, lambda m: mm.lm_loss(m, calib))
        results[(kind, "tp2ep2")] = (_union(_block_amaxes(model, mm)), None)
        mc.save_sharded_checkpoint([model], os.path.join(root, kind))
        export_hf(model, os.path.join(root, f"{kind}_tp2ep2"), format="modelopt", progress=False)
        mm.destroy_model_parallel()

        for tp, ep in LOADS:
            mm.init_model_parallel(tp, ep, seed=1)
            fresh = _build(mm, kind, 11)
            mc.load_sharded_checkpoint([fresh], os.path.join(root, kind))
            with torch.no_grad():
                results[(kind, tp, ep)] = (_union(_block_amaxes(fresh, mm)), mm.gather_logits(fresh, batch))
            mm.destroy_model_parallel()
        if kind == "sequential":  # the grouped test linear has no expert-TP
            _expert_tp(mm, root, calib, batch, results)
    return results


def test_swept_block_scales_are_the_same_at_every_layout_reshard_and_export_bit_exact(tmp_path):
    results = spawn(_worker, 4, args=(str(tmp_path),), timeout=seconds(900))[0]
    for kind in KINDS:
        one_files, rows = _exported_rows(tmp_path / f"{kind}_one_rank")
        split_files, _ = _exported_rows(tmp_path / f"{kind}_tp2ep2")
        assert sorted(split_files) == sorted(one_files)
        for name, t in one_files.items():
            assert torch.equal(split_files[name], t), (kind, name)
        static_rows, dynamic_rows = results[(kind, "rows")]
        assert len(rows) > 2 * 4 * 3 * 32  # every expert's gate, up and down projection, and attention
        assert all(r in static_rows for r in rows), kind
        assert any(r not in dynamic_rows for r in rows), kind
        one, logits = results[(kind, "one rank")]
        assert len([k for k in one if isinstance(k, tuple)]) == 2 * 2 * 4, sorted(one, key=str)  # layers x GEMMs x E
        assert any(isinstance(k, str) and "linear_proj" in k for k in one)  # a row-parallel dense linear
        maxed = results[(kind, "max")][0]
        assert any(not torch.equal(one[k], maxed[k]) for k in one)  # the sweep moved block amaxes
        expert_tp = ("etp2", "etp2 at etp1", "etp1 at etp2") if kind == "sequential" else ()
        for label in ("tp2ep2", *LOADS, *expert_tp):
            got, got_logits = results[(kind, *label)] if isinstance(label, tuple) else results[(kind, label)]
            assert sorted(got, key=str) == sorted(one, key=str), (kind, label)
            for key in one:
                assert torch.equal(got[key], one[key]), (kind, label, key)
            if got_logits is not None:
                assert torch.equal(got_logits, logits) if label in ((1, 1), "etp2 at etp1") else torch.allclose(
                    got_logits, logits, rtol=0, atol=1e-4), (kind, label)
    # Grouped experts hold each expert's weight as Transformer Engine does (weight0..weight{N-1}, [out, in] each): with
    # the same weights they choose SequentialMLP's block amaxes bit for bit, expert by expert, and give its logits.
    (sequential, seq_logits), (grouped, grouped_logits) = (results[(kind, "one rank")] for kind in KINDS)
    assert sorted(grouped, key=str) == sorted(sequential, key=str)
    for key in sequential:
        assert torch.equal(grouped[key], sequential[key]), key
    assert torch.allclose(grouped_logits, seq_logits, rtol=0, atol=1e-4)


def test_learned_block_scales_train_in_megatron_and_checkpoint_their_trained_values(tmp_path_factory):
    root = tmp_path_factory.mktemp("learned_blocks")
    ranks = spawn(_learned_worker, 4, args=(str(root),), timeout=seconds(900))
    for r in ranks:
        assert r["names"]
        assert all(n.endswith("weight_quantizer._block_amax") for n in r["names"])
        assert r["changed"] == len(r["names"])  # every block amax parameter trained
        assert r["dtype"] == {"torch.float32"}  # kept fp32 inside Float16Module
        assert r["loaded_learns"]
    trained, loaded = ranks[0]["trained"], ranks[0]["loaded"]
    assert sorted(loaded, key=str) == sorted(trained, key=str)
    for key, value in trained.items():
        assert torch.equal(loaded[key], value), key


def _learned_worker(rank, world_size, root):
    import megatron_harness.models as mm

    return _learned(mm, root)
