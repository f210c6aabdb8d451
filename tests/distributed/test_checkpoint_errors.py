"""Checkpoints that do not fit, legacy and partial checkpoints, and meta-device restores on 4 gloo ranks (TP=1, EP=2).

One spawn holds every case; each error is raised on every rank at the same point (no collective is left waiting),
and its message is recorded for the tests below to assert.
"""

import os
import shutil
import warnings

import pytest
import torch
from limits import seconds  # noqa: E402
from test_checkpoint_reshard import global_amax, global_params  # noqa: E402 - sibling test module

from modelopt_moe.launch import spawn

WORLD, SEED, EXPERTS = 4, 1234, 8


def _build(mm, seed, experts=EXPERTS):
    return mm.build_moe_gpt(num_layers=2, num_experts=experts, ffn_hidden=64, seed=seed).eval()


def _quantize(mtq, mm, model, preset="fp8_default.yaml", w="per_expert", i="per_expert", axis=None):
    cfg = mtq.load_config(preset)
    cfg.experts.weight_amax, cfg.experts.input_amax = w, i
    if axis is not None:
        cfg.quant_cfg[0].cfg.axis = axis  # the "*weight_quantizer" rule: per-channel weight amax
    calib = mm.text_batches(2, 32, 1)[0]
    return mtq.quantize(model, cfg, lambda m: mm.lm_loss(m, calib))


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the tests assert the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _errors_worker(rank, world_size, root):
    import megatron_harness.models as mm
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    import modelopt_moe.quantization as mtq
    from modelopt_moe.checkpoint import sharded as ck_sharded
    from modelopt_moe.plugins import megatron as mc
    from modelopt_moe.plugins.megatron import checkpoint as mc_checkpoint

    out = {}
    mm.init_model_parallel(1, 2, seed=SEED)
    ckpt = os.path.join(root, "good")
    src = _quantize(mtq, mm, _build(mm, SEED))
    mc.save_sharded_checkpoint([src], ckpt)
    ref = {"amax": global_amax(src, mm), "params": global_params(src, mm)}

    # --- expert count: at restore (fresh model) and in sharded_state_dict (already quantized model, plain load)
    out["count_restore"] = _error(lambda: mc.load_sharded_checkpoint([_build(mm, 1, experts=4)], ckpt))
    four = _quantize(mtq, mm, _build(mm, 1, experts=4))

    def plain_load(model):  # the user's own load call, with the checkpoint's shapes through Megatron's metadata
        dist_checkpointing.load({"model": model.sharded_state_dict(metadata=mc.checkpoint_load_metadata(ckpt))}, ckpt)

    out["count_sharded"] = _error(lambda: plain_load(four))
    # --- number format and amax shape
    out["format"] = _error(lambda: mc.load_sharded_checkpoint([_quantize(mtq, mm, _build(mm, 2), "nvfp4_default.yaml")],
                                                               ckpt))
    out["shape"] = _error(lambda: plain_load(_quantize(mtq, mm, _build(mm, 3), w="vectorized", axis=0)))

    # --- legacy: expert amax saved without the expert axis (one per layer), loads everywhere with a warning
    legacy = os.path.join(root, "legacy")
    if rank == 0:
        os.makedirs(legacy)
    dist.barrier()
    shared = _quantize(mtq, mm, _build(mm, SEED), w="shared", i="shared")
    sd = shared.sharded_state_dict()
    for k, v in list(sd.items()):
        if isinstance(v, ShardedTensorFactory) and ".mlp.experts." in k:
            st = v.build()
            value = st.data.reshape(-1)[0].clone()  # the layer's one amax
            sd[k] = ShardedTensor.from_rank_offsets(st.key, value, (0, st.global_offset[0], st.global_shape[0]),
                                                    replica_id=(0, 0, rank), prepend_axis_num=1)
    dist_checkpointing.save({"model": sd}, legacy)
    ck_sharded.save_sharded_modelopt_state([shared], legacy)
    mm.init_model_parallel(2, 2, seed=SEED)
    target = _build(mm, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mc.load_sharded_checkpoint([target], legacy, experts={"weight_amax": "vectorized", "input_amax": "per_expert"})
    out["legacy_warnings"] = [str(w.message) for w in caught if "no expert axis" in str(w.message)]
    out["legacy_amax"] = {k: v for k, v in global_amax(target, mm).items() if isinstance(k, tuple)}
    layer_max = {}
    for li, layer in enumerate(shared.decoder.layers):
        for gemm in ("linear_fc1", "linear_fc2"):
            for kind in ("weight_quantizer", "input_quantizer"):
                layer_max[(li, gemm, kind)] = getattr(getattr(layer.mlp.experts, gemm), kind).amax.max().clone()
    out["legacy_layer_amax"] = layer_max

    # --- partial save: dies after the weights, before the state and the completion marker
    mm.init_model_parallel(1, 2, seed=SEED)
    model = _quantize(mtq, mm, _build(mm, SEED + 7))
    real = mc_checkpoint.save_sharded_modelopt_state

    def dies(*args, **kwargs):
        raise RuntimeError("injected failure during save")

    mc_checkpoint.save_sharded_modelopt_state = dies
    try:
        out["partial_save"] = _error(lambda: mc.save_sharded_checkpoint([model], ckpt))
    finally:
        mc_checkpoint.save_sharded_modelopt_state = real
    fresh = _build(mm, 11)
    mc.load_sharded_checkpoint([fresh], ckpt)  # the previous checkpoint is intact
    out["previous_loads"] = (all(torch.equal(a, ref["amax"][k]) for k, a in global_amax(fresh, mm).items())
                             and all(torch.equal(a, ref["params"][k]) for k, a in global_params(fresh, mm).items()))
    out["partial_dir"] = ckpt + ".tmp"
    out["partial_load"] = _error(lambda: mc.load_sharded_checkpoint([_build(mm, 12)], ckpt + ".tmp"))
    damaged = os.path.join(root, "damaged")
    if rank == 0:
        shutil.copytree(ckpt, damaged)
        victim = sorted(f for f in os.listdir(damaged) if f.endswith(".distcp"))[-1]
        os.remove(os.path.join(damaged, victim))
        out["victim"] = victim
    dist.barrier()
    out["damaged_load"] = _error(lambda: mc.load_sharded_checkpoint([_build(mm, 13)], damaged))

    # --- meta device: restore the quantization, check the amax entries' shapes, materialise and load
    with torch.device("meta"):
        meta_model = _build(mm, 0)
    ck_sharded.restore_sharded_modelopt_state([meta_model], ckpt)
    shapes = {}
    for k, v in meta_model.sharded_state_dict().items():
        if isinstance(v, ShardedTensorFactory) and k.endswith("_amax"):
            st = v.build()
            shapes[st.key] = st.global_shape
    out["meta_shapes"] = shapes
    out["ckpt_shapes"] = ck_sharded.checkpoint_amax_shapes(ckpt)
    out["meta_repr"] = repr(meta_model) + mtq.print_quant_summary(meta_model, file=False)  # before the weights load
    meta_model.to_empty(device="cpu")
    mc.load_sharded_checkpoint([meta_model], ckpt)
    out["meta_loads"] = (all(torch.equal(a, ref["amax"][k]) for k, a in global_amax(meta_model, mm).items())
                         and all(torch.equal(a, ref["params"][k]) for k, a in global_params(meta_model, mm).items()))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_errors")
    return spawn(_errors_worker, WORLD, args=(str(root),), timeout=seconds(900))


def test_wrong_expert_count_names_key_expected_and_found(results):
    for r in results:
        msg = r["count_restore"]  # found by the shape check, before the restore changes the fresh model
        assert msg.startswith("CheckpointMismatchError"), msg
        assert "decoder.layers.mlp.experts.experts.linear_fc1.weight: the model expects global shape (2, 4, 64, 64)" \
            in msg, msg
        assert "the checkpoint has (2, 8, 64, 64)" in msg, msg
        msg = r["count_sharded"]
        assert "decoder.layers.mlp.experts.experts.linear_fc1" in msg, msg
        assert "expected 4 experts in checkpoint" in msg, msg
        assert "found 8" in msg, msg


def test_wrong_format_names_quantizer_expected_and_found(results):
    msg = results[0]["format"]
    assert msg.startswith("CheckpointMismatchError"), msg
    assert "format mismatch" in msg, msg
    assert "_quantizer" in msg, msg
    assert "expects format nvfp4" in msg, msg
    assert "checkpoint has format e4m3" in msg, msg


def test_wrong_amax_shape_names_key_expected_and_found(results):
    msg = results[0]["shape"]
    assert msg.startswith("CheckpointMismatchError"), msg
    assert "amax shape mismatch" in msg, msg
    assert "_amax" in msg, msg
    assert "expected global shape" in msg, msg
    assert "found" in msg, msg


def test_legacy_checkpoint_without_expert_axis_loads_with_rank0_warning(results):
    assert results[0]["legacy_warnings"], "rank 0 did not warn"
    assert all(not r["legacy_warnings"] for r in results[1:])
    for r in results:
        for (li, gemm, kind, _g), v in r["legacy_amax"].items():
            assert torch.equal(v, r["legacy_layer_amax"][(li, gemm, kind)].reshape(())), (li, gemm, kind)


def test_partial_save_keeps_previous_checkpoint_and_partial_load_fails_clearly(results):
    for r in results:
        assert "injected failure" in r["partial_save"]
        assert r["previous_loads"]
        msg = r["partial_load"]
        assert msg.startswith("IncompleteCheckpointError"), msg
        assert r["partial_dir"] in msg, msg
        assert "modelopt_moe_state.pt" in msg, msg
        assert "modelopt_moe_complete.json" in msg, msg
        assert results[0]["victim"] in r["damaged_load"]
        assert "incomplete" in r["damaged_load"]


def test_meta_device_model_restores_shapes_and_loads_bit_exact(results):
    for r in results:
        assert r["meta_shapes"] == r["ckpt_shapes"]
        assert "amax=None" in r["meta_repr"]  # it prints; the amaxes come with the weights
        assert r["meta_loads"]
