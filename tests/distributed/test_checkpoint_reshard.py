"""Distributed checkpoints of quantized Megatron MoE GPTs on 4 gloo ranks: a reshard matrix.

Every (TP, EP) layout in LAYOUTS saves once (FP8, NVFP4, or MXFP4 / MXFP8 experts; some weight / input amax layout);
every other layout loads each of those checkpoints into a freshly built model of another seed, restoring into
another expert amax layout (all 9 weight-layout pairs and all 4 input-layout pairs occur, every format). Each load
compares, layout-independently (global tensors keyed by global expert index / full TP tensors), every amax and weight
bit-exactly with the saved model's (a `shared` target holds the max over all experts, as the contract says), the
logits on the same batch, and re-saves to check the second checkpoint equals the first key by key (bit-exact;
`shared` targets: the max).
Half the checkpoints are written, and every checkpoint is also read, with the README's flow (the user's own
``dist_checkpointing.save/load`` calls plus ``save/restore_sharded_modelopt_state``), which must give the same model.
Megatron's validate_sharding_integrity runs in every save (dist_checkpointing.save, validate_access_integrity=True)
and every load. One spawn holds all 6 saves and 30 loads (a spawn costs ~15 s of imports).
"""

import os
import shutil

import pytest
import torch
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn

WORLD, SEED, EXPERTS, LAYERS = 4, 1234, 8, 2
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (4, 1)]
W_LAYOUTS = ["vectorized", "per_expert", "shared"]
I_LAYOUTS = ["shared", "per_expert"]
# MX on the experts only: at TP 4 the attention's row-parallel input dim (64 / 4 = 16) would cut a block of 32, which
# mtq.quantize refuses (checked below); experts are not tensor-parallel here.
PRESETS = ["fp8_default.yaml", "mxfp4_experts_only.yaml", "mxfp8_experts_only.yaml", "nvfp4_default.yaml"]
EXPERT_AMAX = ("weight_quantizer", "input_quantizer")


def source_setup(s):
    """Source layout index -> (preset, weight amax layout, input amax layout)."""
    return PRESETS[s % len(PRESETS)], W_LAYOUTS[s % 3], I_LAYOUTS[(s // 2) % 2]


def target_setup(s, t):
    """(source, target) layout indices -> (weight, input) amax layouts to restore into."""
    return W_LAYOUTS[(s + t) % 3], I_LAYOUTS[(s * 5 + t) % 2]


# ------------------------------------------------------------------------------------------------ helpers (in ranks)


def _gather_union(local: dict) -> dict:
    """Union of every rank's dict; a key several ranks hold must hold the same bits everywhere."""
    import torch.distributed as dist

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    out = {}
    for part in parts:
        for k, v in part.items():
            if k in out:
                assert torch.equal(out[k], v), f"ranks disagree on {k}"
            else:
                out[k] = v
    return out


def global_amax(model, mm):
    """{(layer, gemm, kind, global expert) or dense quantizer name: amax}, the same on every rank of any layout."""
    from modelopt_moe.quantization.conversion import named_quantizers

    ep_rank = mm.parallel_layout()["ep_rank"]
    local = {}
    for li, layer in enumerate(model.decoder.layers):
        experts = layer.mlp.experts
        n = experts.num_local_experts
        for gemm in ("linear_fc1", "linear_fc2"):
            for kind in EXPERT_AMAX:
                layout = getattr(getattr(experts, gemm), kind)
                for i in range(n):
                    local[(li, gemm, kind, ep_rank * n + i)] = layout.expert_amax(i).detach().clone().reshape(())
    for name, q, _ in named_quantizers(model):
        if ".mlp.experts." not in name and q.amax is not None:
            local[name] = q.amax.detach().clone()
    return _gather_union(local)


def global_params(model, mm):
    """{global parameter name: full tensor} (TP shards concatenated; experts under their global index)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    local = {}
    for name, p in mm.iter_params_with_global_names(model):
        t = p.detach()
        if tp > 1 and getattr(p, "tensor_model_parallel", False) and getattr(p, "allreduce", True):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, dim=p.partition_dim)
        local[name] = t.clone()
    return _gather_union(local)


def expected_amax(src: dict, w_shared: bool, i_shared: bool) -> dict:
    """What a target layout holds after loading ``src``: a shared expert amax is the max over all experts."""
    out = dict(src)
    maxes = {}
    for k, v in src.items():
        if isinstance(k, tuple):
            maxes[k[:3]] = torch.maximum(maxes.get(k[:3], v), v)
    for k in src:
        if not isinstance(k, tuple):
            continue
        if (k[2] == "weight_quantizer" and w_shared) or (k[2] == "input_quantizer" and i_shared):
            out[k] = maxes[k[:3]]
    return out


def logits_with_shared_max(model, mm, batch, w_shared, i_shared):
    """Logits with the chosen expert amaxes temporarily replaced by the max over all (global) experts."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    saved = []
    ep = parallel_state.get_expert_model_parallel_group()
    for layer in model.decoder.layers:
        for gemm in ("linear_fc1", "linear_fc2"):
            for kind, on in (("weight_quantizer", w_shared), ("input_quantizer", i_shared)):
                q = getattr(getattr(layer.mlp.experts, gemm), kind)
                m = q.amax.max().reshape(1)
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ep)  # every rank, whatever `on` is
                if on:
                    saved.append((q, q.amax.clone()))
                    q.amax = torch.full_like(q.amax, m.item())
    with torch.no_grad():
        logits = mm.gather_logits(model, batch)
    for q, a in saved:
        q.amax = a
    return logits


def read_checkpoint(path):
    """Every tensor of a torch_dist checkpoint, whole (non-distributed read)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path))
    meta = reader.read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
          if isinstance(v, TensorStorageMetadata)}
    dcp.load(sd, storage_reader=reader, no_dist=True)
    return sd


def _is_expert_amax(key, kind):
    return ".mlp.experts.experts.linear_fc" in key and key.endswith(f"{kind}._amax")


def compare_checkpoints(first, second, w_shared, i_shared):
    """Mismatch descriptions between a checkpoint and its re-save (shared targets: the max over experts)."""
    errors = []
    if first.keys() != second.keys():
        return [f"keys differ: only first {sorted(first.keys() - second.keys())[:3]}, only second "
                f"{sorted(second.keys() - first.keys())[:3]}"]
    for k, a in first.items():
        expect = a
        if (w_shared and _is_expert_amax(k, "weight_quantizer")) or (
                i_shared and _is_expert_amax(k, "input_quantizer")):
            expect = a.amax(dim=1, keepdim=True).expand_as(a)  # [L, E]: the layer's max for every expert
        if not torch.equal(expect, second[k]):
            errors.append(f"{k}: re-saved checkpoint differs")
    return errors


def compare(tag, got: dict, want: dict):
    errors = []
    if got.keys() != want.keys():
        errors.append(f"{tag}: keys differ: {sorted(map(str, got.keys() - want.keys()))[:3]} vs "
                      f"{sorted(map(str, want.keys() - got.keys()))[:3]}")
    for k in got.keys() & want.keys():
        if not torch.equal(got[k], want[k]):
            errors.append(f"{tag}: {k} differs")
    return errors[:5]


def assign_amax(model, mm, amax: dict):
    """Sets every amax of a quantized model from a :func:`global_amax` dict (no checkpoint involved)."""
    from modelopt_moe.quantization.conversion import named_quantizers

    ep_rank = mm.parallel_layout()["ep_rank"]
    for li, layer in enumerate(model.decoder.layers):
        experts = layer.mlp.experts
        n = experts.num_local_experts
        for gemm in ("linear_fc1", "linear_fc2"):
            for kind in EXPERT_AMAX:
                q = getattr(getattr(experts, gemm), kind)
                q.amax = torch.stack([amax[(li, gemm, kind, ep_rank * n + i)] for i in range(n)])
    for name, q, _ in named_quantizers(model):
        if name in amax:
            q.amax = amax[name]


def readme_save(model, ckpt):
    """The README's save with the user's own Megatron call."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from modelopt_moe.checkpoint import save_sharded_modelopt_state

    if dist.get_rank() == 0:
        os.makedirs(ckpt)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict()}, ckpt)
    save_sharded_modelopt_state([model], ckpt)
    dist.barrier()


def readme_load(model, ckpt, experts):
    """The README's restore with the user's own Megatron call, into a freshly built model."""
    from megatron.core import dist_checkpointing

    from modelopt_moe.checkpoint import restore_sharded_modelopt_state

    restore_sharded_modelopt_state([model], ckpt, experts)
    model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt)["model"])


def build(mm, seed):
    return mm.build_moe_gpt(num_layers=LAYERS, num_experts=EXPERTS, ffn_hidden=64, seed=seed).eval()


# ---------------------------------------------------------------------------------------------------------- worker


def _matrix_worker(rank, world_size, root):
    import time

    import megatron_harness.models as mm
    import torch.distributed as dist

    import modelopt_moe.quantization as mtq
    from modelopt_moe.plugins import megatron as mc

    calib, batch = mm.text_batches(2, 32, 2)[0], mm.text_batches(2, 32, 1, offset=7)[0]
    refs, cases, timings = {}, [], {}
    t0 = time.time()
    for s, (tp, ep) in enumerate(LAYOUTS):  # ---- saves
        preset, w, i = source_setup(s)
        mm.init_model_parallel(tp, ep, seed=SEED)
        model = build(mm, SEED)
        cfg = mtq.load_config(preset)
        cfg.experts.weight_amax, cfg.experts.input_amax = w, i
        # Amaxes as calibrated and loaded: a dynamic weight amax would be recomputed from the weights on re-save.
        cfg.weight_amax_update = "static"
        mtq.quantize(model, cfg, lambda m: mm.lm_loss(m, calib))
        if tp == 4:  # MX everywhere: the attention's row-parallel input dim is cut into parts of 16
            try:
                mtq.quantize(build(mm, SEED), mtq.load_config("mxfp4_default.yaml"))
            except mtq.ConfigError as e:
                timings["mx_tp4_error"] = str(e)
        ref = {"amax": global_amax(model, mm), "params": global_params(model, mm), "logits": {}}
        for ws in (False, True):
            for is_ in (False, True):
                ref["logits"][(ws, is_)] = logits_with_shared_max(model, mm, batch, ws, is_)
        ckpt = os.path.join(root, f"src{s}")
        if s % 2:
            readme_save(model, ckpt)
        else:
            mc.save_sharded_checkpoint([model], ckpt)
        refs[s] = ref
        del model
    timings["saves"] = time.time() - t0
    first = {}
    if rank == 0:
        first = {s: read_checkpoint(os.path.join(root, f"src{s}")) for s in range(len(LAYOUTS))}
        from torch.distributed.checkpoint import FileSystemReader

        meta = FileSystemReader(os.path.join(root, "src3")).read_metadata().state_dict_metadata
        timings["keys"] = {k: tuple(v.size) for k, v in meta.items() if k.endswith("_amax")}
    t1 = time.time()
    for t, (tp, ep) in enumerate(LAYOUTS):  # ---- loads
        mm.init_model_parallel(tp, ep, seed=SEED)
        for s in range(len(LAYOUTS)):
            if s == t:
                continue
            w, i = target_setup(s, t)
            model = build(mm, SEED + 1 + s)
            mc.load_sharded_checkpoint([model], os.path.join(root, f"src{s}"),
                                       experts={"weight_amax": w, "input_amax": i})
            w_shared, i_shared = w == "shared", i == "shared"
            errors = compare("amax", global_amax(model, mm), expected_amax(refs[s]["amax"], w_shared, i_shared))
            errors += compare("params", global_params(model, mm), refs[s]["params"])
            # The README's flow with the user's own dist_checkpointing calls gives the same model.
            plain = build(mm, SEED + 2 + s)
            readme_load(plain, os.path.join(root, f"src{s}"), {"weight_amax": w, "input_amax": i})
            errors += compare("readme-flow amax", global_amax(plain, mm),
                              expected_amax(refs[s]["amax"], w_shared, i_shared))
            errors += compare("readme-flow params", global_params(plain, mm), refs[s]["params"])
            del plain
            with torch.no_grad():
                logits = mm.gather_logits(model, batch)
            want = refs[s]["logits"][(w_shared, i_shared)]
            diff = (logits - want).abs().max().item()
            # The same logical model at this layout with the expected amaxes set directly: the same bits.
            direct = build(mm, SEED)
            cfg = mtq.load_config(source_setup(s)[0])
            cfg.experts.weight_amax, cfg.experts.input_amax = w, i
            cfg.weight_amax_update = "static"
            mtq.quantize(direct, cfg)
            assign_amax(direct, mm, expected_amax(refs[s]["amax"], w_shared, i_shared))
            with torch.no_grad():
                if not torch.equal(mm.gather_logits(direct, batch), logits):
                    errors.append("logits differ from the same model with the expected amaxes set directly")
            del direct
            resave = os.path.join(root, f"re{s}_{t}")
            mc.save_sharded_checkpoint([model], resave)
            if rank == 0:
                errors += compare_checkpoints(first[s], read_checkpoint(resave), w_shared, i_shared)
                shutil.rmtree(resave)
            cases.append({"src": LAYOUTS[s], "dst": LAYOUTS[t], "preset": source_setup(s)[0],
                          "w": (source_setup(s)[1], w), "i": (source_setup(s)[2], i), "errors": errors,
                          "logit_diff": diff, "logit_scale": want.abs().max().item()})
            del model
            dist.barrier()
    timings["loads"] = time.time() - t1
    return {"cases": cases, "timings": timings}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    return spawn(_matrix_worker, WORLD, args=(str(root),), timeout=seconds(900))


def test_reshard_matrix_covers_every_layout_pair_format_and_amax_layout_pair(matrix):
    cases = matrix[0]["cases"]
    pairs = {(c["src"], c["dst"]) for c in cases}
    assert pairs == {(a, b) for a in LAYOUTS for b in LAYOUTS if a != b}
    assert {c["w"] for c in cases} == {(a, b) for a in W_LAYOUTS for b in W_LAYOUTS}
    assert {c["i"] for c in cases} == {(a, b) for a in I_LAYOUTS for b in I_LAYOUTS}
    assert {c["preset"] for c in cases} == set(PRESETS)


def test_reshard_every_load_is_bit_exact_in_amax_weights_and_resaved_checkpoint(matrix):
    failures = [(c["src"], c["dst"], c["w"], c["i"], e) for r in matrix for c in r["cases"] for e in c["errors"]]
    assert not failures, failures[:10]


def test_reshard_logits_match_the_saved_model(matrix):
    # Bit-exact against the same layout is checked with the other errors; across layouts the reductions run in
    # another order (~1e-7 relative), which can flip a rare fake-quant rounding: a loose bound catches gross errors.
    for c in matrix[0]["cases"]:
        assert c["logit_diff"] <= 1e-2 * max(1.0, c["logit_scale"]), c


def test_mx_blocks_cut_by_the_tensor_parallel_split_are_refused_naming_the_layer_shape_and_tp(matrix):
    text = matrix[0]["timings"].get("mx_tp4_error", "")
    assert "decoder.layers.0.self_attention.linear_proj.weight_quantizer: MXFP4" in text
    assert "4 parts of 16 of 64" in text
    assert "TP 4" in text
    assert "use TP in [1, 2]" in text
    assert "linear_qkv" not in text  # column-parallel: the input dim is whole


def test_checkpoint_key_scheme_has_layer_and_global_expert_axes(matrix):
    keys = matrix[0]["timings"]["keys"]
    for gemm in ("linear_fc1", "linear_fc2"):
        for kind in EXPERT_AMAX:
            assert keys[f"decoder.layers.mlp.experts.experts.{gemm}.{kind}._amax"] == (LAYERS, EXPERTS)
    assert keys["decoder.layers.self_attention.linear_qkv.weight_quantizer._amax"] == (LAYERS,)
    assert not any(".local_experts." in k or k.endswith((".0._amax", ".1._amax")) for k in keys)
