"""A real Megatron-Core MoE GPT on 4 gloo processes (CPU): TP=2/EP=2 matches TP=1/EP=1 with the same seed.

One spawn holds all checks: each spawn costs ~10-15 s, mostly imports.
"""

import math

import pytest
import torch
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn

WORLD = 4
SEED = 1234
BATCH, SEQ, VOCAB, EXPERTS = 2, 32, 256, 4


def _param_digest(model, mm):
    """Global name -> local shard of each parameter (experts under their global index)."""
    return {name: p.detach().clone() for name, p in mm.iter_params_with_global_names(model)}


def _layouts_worker(rank, world_size):
    import megatron_harness.models as mm

    from modelopt_moe.plugins import megatron_cpu as shims

    out = {"shims": (shims.apply_cpu_shims(), shims.apply_cpu_shims(), str(torch.cuda.current_device()))}
    batches = mm.text_batches(BATCH, SEQ, 2, VOCAB)

    # Reference layout: TP=1/EP=1 (all 4 ranks are data-parallel replicas of the full model).
    mm.init_model_parallel(1, 1, seed=SEED)
    ref = mm.build_moe_gpt(seed=SEED).eval()
    ref_params = _param_digest(ref, mm)
    with torch.no_grad():
        out["ref_logits"] = mm.gather_logits(ref, batches[0])
        out["ref_loss"] = mm.lm_loss(ref, batches[1]).item()
    del ref
    mm.destroy_model_parallel()

    # Layout under test: TP=2/EP=2, same seed.
    mm.init_model_parallel(2, 2, seed=SEED)
    model = mm.build_moe_gpt(seed=SEED)
    out.update(mm.parallel_layout())
    out["sequence_parallel"] = model.config.sequence_parallel
    out["embedding_shard"] = tuple(model.embedding.word_embeddings.weight.shape)
    out["local_experts"] = sorted(n for n, _ in mm.iter_params_with_global_names(model) if "local_experts" in n)
    # Every expert parameter equals the reference's expert with the same global index (ETP=1: unsplit).
    out["experts_equal_ref"] = all(
        torch.equal(p, ref_params[n]) for n, p in _param_digest(model, mm).items() if "local_experts" in n
    )
    out["dense_params"] = {n: p for n, p in _param_digest(model, mm).items() if "local_experts" not in n}

    model.eval()
    with torch.no_grad():
        out["logits"] = mm.gather_logits(model, batches[0])
        out["loss"] = mm.lm_loss(model, batches[1]).item()

    # Training mode at TP=2 (needs sequence parallelism): backward runs, norm grads agree over TP after the sync.
    model.train()
    loss = mm.lm_loss(model, batches[1])
    loss.backward()
    mm.allreduce_sequence_parallel_grads(model)
    out["train_loss"] = loss.item()
    out["grads_finite"] = all(torch.isfinite(p.grad).all().item() for p in model.parameters() if p.grad is not None)
    out["norm_grad"] = model.decoder.final_layernorm.weight.grad.clone()
    mm.destroy_model_parallel()

    # A different seed gives a different model (the seed is really used).
    mm.init_model_parallel(2, 2, seed=SEED + 1)
    other = mm.build_moe_gpt(seed=SEED + 1).eval()
    with torch.no_grad():
        out["other_logits"] = mm.gather_logits(other, batches[0])
    mm.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_layouts_worker, WORLD, timeout=seconds(900))


def test_cpu_shims_are_idempotent_and_route_cuda_device_to_cpu(results):
    assert all(r["shims"] == (True, True, "cpu") for r in results)


def test_tp2ep2_layout_shards_the_model(results):
    # Megatron's orders: TP varies fastest over dense ranks; the expert grid (ETP=1) has EP fastest.
    assert [r["tp_rank"] for r in results] == [0, 1, 0, 1]
    assert sorted(r["ep_rank"] for r in results) == [0, 0, 1, 1]
    for r in results:
        assert (r["tp"], r["ep"], r["dp"]) == (2, 2, 2)
        assert r["sequence_parallel"] is True
        assert r["embedding_shard"] == (VOCAB // 2, 64)
        base = r["ep_rank"] * EXPERTS // 2  # experts under their global index: ep rank 1 holds experts 2 and 3
        assert {int(n.split("local_experts.")[1].split(".")[0]) for n in r["local_experts"]} == {base, base + 1}
        assert r["experts_equal_ref"]


def test_tp2ep2_forward_gives_finite_logits_of_full_vocab(results):
    for r in results:
        assert r["logits"].shape == (BATCH, SEQ, VOCAB)
        assert torch.isfinite(r["logits"]).all()
        assert math.isfinite(r["loss"])


def test_tp2ep2_matches_tp1ep1_with_the_same_seed(results):
    for r in results:
        torch.testing.assert_close(r["logits"], r["ref_logits"], rtol=1e-5, atol=1e-5)
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
        assert r["train_loss"] == pytest.approx(r["ref_loss"], rel=1e-5)  # no dropout: train == eval numerics
    # A random byte-level model is near uniform over 256 tokens; a wiring bug would show as a very different loss.
    assert abs(results[0]["ref_loss"] - math.log(VOCAB)) < 0.5


def test_same_seed_gives_identical_replicas_and_other_seed_differs(results):
    for r in results[1:]:
        torch.testing.assert_close(r["logits"], results[0]["logits"], rtol=0, atol=0)
    # Ranks 0 and 2 hold the same tensor-parallel shard of the dense weights (data-parallel replicas).
    for a, b in ((0, 2), (1, 3)):
        da, db = results[a]["dense_params"], results[b]["dense_params"]
        assert da.keys() == db.keys()
        assert all(torch.equal(da[k], db[k]) for k in da)
    assert not torch.allclose(results[0]["other_logits"], results[0]["logits"])


def test_training_step_at_tp2_has_finite_grads_synced_over_tp(results):
    assert all(r["grads_finite"] for r in results)
    for r in results[1:]:
        torch.testing.assert_close(r["norm_grad"], results[0]["norm_grad"], rtol=1e-6, atol=1e-7)
