"""Distributed checkpoints of a quantized ``TEGroupedMLP`` MoE layer on 2 GPUs (NCCL): saved at EP=2 and restored at
EP=1, and the reverse, every amax and weight bit-exact; restoring into another amax layout keeps the contract.

Needs 2 GPUs; skips with fewer.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)
pytest.importorskip("transformer_engine.pytorch")

from modelopt_moe.launch import spawn  # noqa: E402

EXPERTS, HIDDEN, FFN = 8, 256, 512
CASES = [  # (preset, saved at EP, saved weight layout, restored at EP, restored weight layout)
    ("fp8_default.yaml", 2, "vectorized", 1, "vectorized"),
    ("fp8_default.yaml", 1, "vectorized", 2, "per_expert"),
    ("nvfp4_default.yaml", 2, "per_expert", 1, "vectorized"),
    ("nvfp4_default.yaml", 1, "vectorized", 2, "vectorized"),
]


def _global_state(layer):
    """{(gemm, kind, global expert): tensor} for the weights and the expert amaxes, from all ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    n = layer.experts.linear_fc1.num_gemms
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    local = {}
    for gemm in ("linear_fc1", "linear_fc2"):
        linear = getattr(layer.experts, gemm)
        for i in range(n):
            g = ep_rank * n + i
            local[(gemm, "weight", g)] = getattr(linear, f"weight{i}").detach().cpu()
            for kind in ("weight_quantizer", "input_quantizer"):
                local[(gemm, kind, g)] = getattr(linear, kind).expert_amax(i).detach().cpu()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    merged = {}
    for part in parts:
        for k, v in part.items():
            assert k not in merged or torch.equal(merged[k], v), f"ranks disagree on {k}"
            merged[k] = v
    return merged


def _hidden(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(64, 2, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)


def _worker(rank, world_size, root):
    import warnings

    import megatron_harness.models as mm

    import modelopt_moe.quantization as mtq
    from modelopt_moe.plugins.megatron import load_sharded_checkpoint, save_sharded_checkpoint

    results = []
    for c, (preset, src_ep, src_layout, dst_ep, dst_layout) in enumerate(CASES):
        ckpt = f"{root}/case{c}"
        mm.init_model_parallel(1, src_ep, seed=1)
        layer = mm.build_moe_layer(transformer_engine=True, num_experts=EXPERTS, hidden=HIDDEN, ffn_hidden=FFN,
                                   seed=7)
        cfg = mtq.load_config(preset)
        cfg.experts.weight_amax, cfg.experts.input_amax = src_layout, "per_expert"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mtq.quantize(layer, cfg, lambda m: [m(_hidden(10 * rank + s)) for s in range(2)])
        saved = _global_state(layer)
        x = _hidden(100 + rank)
        with torch.no_grad():
            y_saved = layer(x)[0].float().cpu()
        save_sharded_checkpoint(layer, ckpt)
        mm.destroy_model_parallel()

        mm.init_model_parallel(1, dst_ep, seed=1)
        fresh = mm.build_moe_layer(transformer_engine=True, num_experts=EXPERTS, hidden=HIDDEN, ffn_hidden=FFN,
                                   seed=99)  # other weights: everything must come from the checkpoint
        load_sharded_checkpoint(fresh, ckpt, experts={"weight_amax": dst_layout, "input_amax": "per_expert"})
        loaded = _global_state(fresh)
        with torch.no_grad():
            y_loaded = fresh(x)[0].float().cpu()
        results.append({
            "case": CASES[c],
            "keys_equal": sorted(saved) == sorted(loaded),
            "mismatched": [k for k in saved if not torch.equal(saved[k], loaded.get(k, torch.empty(0)))],
            "n_keys": len(saved),
            "layout": fresh.experts.linear_fc1.weight_quantizer.layout,
            "rel_out": ((y_loaded - y_saved).norm() / y_saved.norm()).item(),
        })
        mm.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn(_worker, 2, args=(str(tmp_path_factory.mktemp("ckpt")),), timeout=540, backend="nccl")


@pytest.mark.parametrize("case", range(len(CASES)))
def test_te_grouped_checkpoint_restores_bit_exact_across_ep(results, case):
    for r in results:
        res = r[case]
        assert res["keys_equal"]
        assert res["n_keys"] == 2 * 3 * EXPERTS
        assert res["mismatched"] == [], res["mismatched"][:5]
        assert res["layout"] == CASES[case][4]
        # Same weights and amaxes; only the grouped GEMM's token split per expert differs between EP layouts.
        assert res["rel_out"] < 1e-2, res["rel_out"]
