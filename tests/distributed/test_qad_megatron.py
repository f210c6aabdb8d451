"""Quantization-aware distillation in Megatron on 4 gloo ranks (one spawn for the whole module).

* The KL and cross entropy on vocabulary-parallel logits equal those of the gathered logits (framework-free logits
  split over the TP group), and Megatron's own vocab-parallel cross entropy; so do the KL chunked over tokens and the
  top-k KL (the teacher's global top k, gathered from the shards).
* ``distillation_model(student, teacher)``: the same per-token loss at TP=2 x EP=2 and TP=1 x EP=2 for the same
  weights and tokens; so are the held-out evaluation's teacher-forced top-1 agreement and greedy generation.
* At TP=2 x CP=2: each CP rank's per-token KL (load-balanced token split, vocabulary slice) is the whole sequence's
  there, and a dense input amax is reduced over the CP ranks too (their tokens differ), as the experts' group holds
  them.
* Wrapped in ``Float16Module`` + Megatron DDP + ``get_megatron_optimizer``: DDP and the optimizer hold the student's
  parameters only; a step through ``get_forward_backward_func`` changes the student and leaves the teacher (no
  gradient) untouched.
* The default ``QADRecipe`` in Megatron's machinery: only the expert weights reach DDP and the optimizer, the
  learning rate warms up from 0 and decays to ``min_lr``.

The QAD study (what the default recipe wins over PTQ) is tested with its tool, in tests/tools/test_qad_study.py.
"""

import math

import pytest
import torch
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn

WORLD, SEED = 4, 1234


def _vocab_parallel_checks(tp_group):
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    from modelopt_moe.distill import logits_kl_loss, vocab_parallel_cross_entropy

    r, n = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    g = torch.Generator().manual_seed(5)
    s, t = torch.randn(2, 7, 96, generator=g) * 4, torch.randn(2, 7, 96, generator=g) * 4
    labels = torch.randint(0, 96, (2, 7), generator=g)
    shard = slice(r * 96 // n, (r + 1) * 96 // n)
    full_s = s.clone().requires_grad_(True)
    part_s = s[..., shard].clone().requires_grad_(True)
    out = {}
    kl_full = logits_kl_loss(full_s, t, temperature=1.5)
    kl_part = logits_kl_loss(part_s, t[..., shard], temperature=1.5, tp_group=tp_group)
    (kl_full.sum()).backward()
    (kl_part.sum()).backward()
    out["kl_diff"] = (kl_full - kl_part).abs().max().item()
    out["kl_grad_diff"] = (full_s.grad[..., shard] - part_s.grad).abs().max().item()
    # chunked over tokens (3 a chunk: 5 chunks of 14 tokens) on the vocabulary slice, bf16 logits as Megatron's
    chunk_s = s[..., shard].bfloat16().requires_grad_(True)
    whole_s = s.bfloat16().requires_grad_(True)
    kl_chunked = logits_kl_loss(chunk_s, t[..., shard].bfloat16(), temperature=1.5, tp_group=tp_group, chunk_tokens=3)
    kl_whole = logits_kl_loss(whole_s, t.bfloat16(), temperature=1.5)
    kl_chunked.sum().backward()
    kl_whole.sum().backward()
    out["chunked_kl_diff"] = (kl_chunked - kl_whole).abs().max().item()
    out["chunked_kl_grad_diff"] = (chunk_s.grad.float() - whole_s.grad[..., shard].float()).abs().max().item()
    # top-k: the global top k of the teacher, whatever shard holds it
    topk_s, topk_full_s = s[..., shard].clone().requires_grad_(True), s.clone().requires_grad_(True)
    kl_topk = logits_kl_loss(topk_s, t[..., shard], temperature=1.5, tp_group=tp_group, top_k=20, chunk_tokens=4)
    kl_topk_full = logits_kl_loss(topk_full_s, t, temperature=1.5, top_k=20)
    kl_topk.sum().backward()
    kl_topk_full.sum().backward()
    out["topk_kl_diff"] = (kl_topk - kl_topk_full).abs().max().item()
    out["topk_kl_grad_diff"] = (topk_s.grad - topk_full_s.grad[..., shard]).abs().max().item()
    out["topk_differs_from_exact"] = (kl_topk - kl_full).abs().max().item()
    # top-p: the nucleus of the whole vocabulary's teacher distribution, whatever shards hold it (bf16, chunked)
    topp_s, topp_full_s = s[..., shard].bfloat16().requires_grad_(True), s.bfloat16().requires_grad_(True)
    kl_topp = logits_kl_loss(topp_s, t[..., shard].bfloat16(), temperature=1.5, tp_group=tp_group, top_p=0.9,
                             chunk_tokens=4)
    kl_topp_full = logits_kl_loss(topp_full_s, t.bfloat16(), temperature=1.5, top_p=0.9)
    kl_topp.sum().backward()
    kl_topp_full.sum().backward()
    out["topp_kl_diff"] = (kl_topp - kl_topp_full).abs().max().item()
    out["topp_kl_grad_diff"] = (topp_s.grad.float() - topp_full_s.grad[..., shard].float()).abs().max().item()
    out["topp_differs_from_exact"] = (kl_topp - kl_full).abs().max().item()
    ce_part = vocab_parallel_cross_entropy(s[..., shard], labels, tp_group=tp_group)
    ce_full = vocab_parallel_cross_entropy(s, labels)
    ce_megatron = tensor_parallel.vocab_parallel_cross_entropy(s[..., shard].clone().transpose(0, 1).contiguous(),
                                                               labels.transpose(0, 1).contiguous()).transpose(0, 1)
    out["ce_diff"] = (ce_full - ce_part).abs().max().item()
    out["ce_megatron_diff"] = (ce_megatron - ce_part).abs().max().item()
    return out


def _distillation_losses(mm, batch):
    """The per-token loss of distillation_model(student, teacher) (KL + 0.5 LM) at the current layout, fp32."""
    from modelopt_moe.plugins.megatron import distillation_model

    student = mm.build_moe_gpt(seed=SEED)
    teacher = mm.build_moe_gpt(seed=SEED + 1)
    model = distillation_model(student, teacher, temperature=2.0, lm_loss_weight=0.5).eval()
    with torch.no_grad():
        return model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])


def _agreement(mm, batch, tp_group):
    """What the KL does not show, at the current layout: teacher-forced top-1 agreement (vocabulary-parallel, and
    from the gathered logits), and greedy generation from 2 prompts of 5 tokens (padded to the TP size)."""
    from modelopt_moe.plugins.cli.agreement import greedy_generate, top1_agreement
    from modelopt_moe.plugins.cli.evaluate import gather_logits

    student = mm.build_moe_gpt(seed=SEED).eval()
    teacher = mm.build_moe_gpt(seed=SEED, params_dtype=torch.bfloat16).eval()  # close to it: most tokens agree
    tp = torch.distributed.get_world_size(tp_group)
    with torch.no_grad():
        gathered = (gather_logits(student, batch).argmax(-1) == gather_logits(teacher, batch).argmax(-1)).float()
    return {"top1": top1_agreement(student, teacher, [batch], tp_group), "top1_gathered": gathered.mean().item(),
            "generated": greedy_generate(student, batch["tokens"][:, :5], 4, multiple_of=tp)}


def _context_parallel_checks():
    """TP=2 x CP=2 (EP=2 beside them): the KL of each CP rank's tokens (Megatron's load-balanced split: chunks r and
    2 * cp - 1 - r of 2 * cp) on its vocabulary slice, and a dense input amax calibrated on other tokens per rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    import modelopt_moe.quantization as mtq
    from modelopt_moe.distill import logits_kl_loss
    from modelopt_moe.plugins.megatron.modules import megatron_amax_groups

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2,
                                             expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED, inference_rng_tracker=True, force_reset_rng=True)
    tp_group, cp_group = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_context_parallel_group()
    tp_r, cp_r = dist.get_rank(tp_group), dist.get_rank(cp_group)
    g = torch.Generator().manual_seed(7)
    s, t = torch.randn(2, 16, 96, generator=g) * 4, torch.randn(2, 16, 96, generator=g) * 4
    chunks = list(torch.arange(16).chunk(4))
    mine = torch.cat([chunks[cp_r], chunks[3 - cp_r]])
    vocab = slice(tp_r * 48, (tp_r + 1) * 48)
    part = s[:, mine, vocab].clone().requires_grad_(True)
    whole = s.clone().requires_grad_(True)
    kl_part = logits_kl_loss(part, t[:, mine, vocab], temperature=1.5, tp_group=tp_group, chunk_tokens=5)
    kl_whole = logits_kl_loss(whole, t, temperature=1.5)
    kl_part.sum().backward()
    kl_whole.sum().backward()
    total = kl_part.detach().sum().reshape(1)
    dist.all_reduce(total, group=cp_group)  # the micro-batch's loss: summed over the CP ranks' tokens
    out = {"kl_diff": (kl_part - kl_whole[:, mine]).abs().max().item(),
           "kl_grad_diff": (part.grad - whole.grad[:, mine, vocab]).abs().max().item(),
           "kl_mean_diff": abs(total.item() / kl_whole.numel() - kl_whole.mean().item())}
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, tensor_model_parallel_size=2,
                            context_parallel_size=2, params_dtype=torch.float32, gradient_accumulation_fusion=False)
    model = torch.nn.Sequential(ColumnParallelLinear(16, 32, config=cfg, init_method=torch.nn.init.normal_,
                                                     bias=False, gather_output=False))
    rank = dist.get_rank()
    x = torch.randn(6, 1, 16, generator=torch.Generator().manual_seed(rank)) * (1 + rank)  # other tokens per rank
    mtq.quantize(model, {"quant_cfg": [{"quantizer_name": "*input_quantizer", "cfg": {"num_bits": "e4m3",
                                                                                       "axis": None}}],
                         "algorithm": "max"}, lambda m: m(x))
    local_max = x.abs().max().reshape(1)
    dist.all_reduce(local_max, op=dist.ReduceOp.MAX)
    groups = megatron_amax_groups()
    cp_ranks = set(dist.get_process_group_ranks(cp_group))
    out.update(amax=model[0].input_quantizer.amax.item(), world_max=local_max.item(),
               dp_has_cp=cp_ranks <= set(dist.get_process_group_ranks(groups["dp"])),
               edp_has_cp=cp_ranks <= set(dist.get_process_group_ranks(groups["edp"])))
    return out


def _wrapped_training(mm, mt, batches):
    """Float16Module + DDP + Megatron's optimizer around distillation_model(quantized student, bf16 teacher)."""
    import warnings

    from megatron_harness.configs import expert_quant_config

    import modelopt_moe.quantization as mtq
    from modelopt_moe.plugins.megatron import distillation_model

    teacher = mm.build_moe_gpt(seed=SEED, params_dtype=torch.bfloat16).eval()
    student = mm.build_moe_gpt(seed=SEED, params_dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(student, expert_quant_config("nvfp4", "dynamic"), lambda m: [mm.lm_loss(m, b) for b in batches])
    teacher_before = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    student_before = {n: p.detach().clone() for n, p in student.named_parameters()}
    trainer = mt.setup_training(distillation_model(student, teacher), lr=1e-3, reuse_quantized_weights=True)
    opt_params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    ddp_params = list(trainer.model.parameters())
    out = {
        "teacher_in_ddp": any(p is q for p in ddp_params for q in teacher.parameters()),
        "ddp_numel": sum(p.numel() for p in ddp_params),
        "student_numel": sum(p.numel() for p in student.parameters()),
        "opt_numel": sum(p.numel() for p in opt_params),
        "unwrapped_is_student": mt.unwrap(trainer.model) is student,
    }
    out["losses"] = mt.train(trainer, batches, steps=2, num_microbatches=2)
    out["teacher_unchanged"] = all(torch.equal(p, teacher_before[n]) for n, p in teacher.named_parameters())
    out["teacher_grads"] = [n for n, p in teacher.named_parameters() if p.grad is not None]
    out["student_changed"] = sum(not torch.equal(p, student_before[n]) for n, p in student.named_parameters())
    out["student_params"] = len(student_before)
    return out


def _recipe_training(mm, mt, batches):
    """The default QADRecipe through select_trainable and setup_training(recipe=...): what trains, and the learning
    rate of every step."""
    from modelopt_moe.distill import QADRecipe
    from modelopt_moe.plugins.megatron import distillation_model, select_trainable

    recipe = QADRecipe()
    teacher = mm.build_moe_gpt(seed=SEED, params_dtype=torch.bfloat16).eval()
    student = mm.build_moe_gpt(seed=SEED, params_dtype=torch.bfloat16)
    counts = select_trainable(student, recipe)
    trainer = mt.setup_training(distillation_model(student, teacher, recipe=recipe), recipe=recipe, lr_decay_steps=20)
    lrs = []
    for step in range(20):
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
        mt.train_step(trainer, [batches[step % len(batches)]], step=step)
    lrs.append(trainer.optimizer.param_groups[0]["lr"])
    return {"counts": counts, "lrs": lrs, "recipe": recipe,
            "opt_numel": sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"]),
            "expert_numel": sum(p.numel() for n, p in student.named_parameters() if ".experts." in n),
            "student_numel": sum(p.numel() for p in student.parameters()),
            "stub_optimizers": sum(getattr(o, "is_stub_optimizer", False)
                                   for o in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])),
            "requires_grad": {n: p.requires_grad for n, p in student.named_parameters()},
            "betas": trainer.optimizer.param_groups[0].get("betas")}


def _worker(rank, world_size):
    import megatron_harness.models as mm
    from megatron.core import parallel_state

    from modelopt_moe.plugins.megatron import training as mt

    batch = mm.text_batches(2, 32, 1, offset=300)[0]
    out = {}
    mm.init_model_parallel(2, 2, seed=SEED)
    out["vocab_parallel"] = _vocab_parallel_checks(parallel_state.get_tensor_model_parallel_group())
    out["loss_tp2"] = _distillation_losses(mm, batch)
    out["agreement_tp2"] = _agreement(mm, batch, parallel_state.get_tensor_model_parallel_group())
    out["training"] = _wrapped_training(mm, mt, mm.text_batches(2, 32, 4))
    out["recipe"] = _recipe_training(mm, mt, mm.text_batches(2, 32, 4))
    mm.init_model_parallel(1, 2, seed=SEED)
    out["loss_tp1"] = _distillation_losses(mm, batch)
    out["agreement_tp1"] = _agreement(mm, batch, parallel_state.get_tensor_model_parallel_group())
    out["context_parallel"] = _context_parallel_checks()
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, WORLD, timeout=seconds(900))


def test_vocab_parallel_losses_equal_the_gathered_ones(results):
    for r in results:
        v = r["vocab_parallel"]
        assert v["kl_diff"] < 1e-5, v
        assert v["kl_grad_diff"] < 1e-6, v
        assert v["chunked_kl_diff"] < 1e-5, v
        assert v["chunked_kl_grad_diff"] < 1e-6, v
        assert v["topk_kl_diff"] < 1e-5, v
        assert v["topk_kl_grad_diff"] < 1e-6, v
        assert v["topk_differs_from_exact"] > 1e-3, v
        assert v["topp_kl_diff"] < 1e-5, v
        assert v["topp_kl_grad_diff"] < 1e-6, v
        assert v["topp_differs_from_exact"] > 1e-3, v
        assert v["ce_diff"] < 1e-5, v
        assert v["ce_megatron_diff"] < 1e-5, v


def test_kl_and_amax_are_correct_at_context_parallel_2(results):
    for r in results:
        c = r["context_parallel"]
        assert c["kl_diff"] < 1e-5, c  # each CP rank's tokens: the KL of the whole sequence there
        assert c["kl_grad_diff"] < 1e-6, c
        assert c["kl_mean_diff"] < 1e-5, c  # summed over CP ranks: the whole sequence's
        assert c["amax"] == c["world_max"], c  # reduced over TP and CP (the CP ranks' tokens differ)
        assert c["dp_has_cp"], c  # dense amax reductions span the CP ranks
        assert c["edp_has_cp"], c  # so do the experts' (expert data parallel holds CP)


def test_distillation_loss_at_tp2_equals_tp1(results):
    tp2, tp1 = results[0]["loss_tp2"], results[0]["loss_tp1"]
    assert tp2.shape == tp1.shape == (2, 32)
    assert tp2.mean() > 0.01  # two different models: a real KL
    torch.testing.assert_close(tp2, tp1, rtol=1e-4, atol=1e-5)
    for r in results:  # the same per-token loss on every rank
        assert torch.equal(r["loss_tp2"], tp2)
        assert torch.equal(r["loss_tp1"], tp1)


def test_top1_agreement_and_greedy_generation_are_the_same_at_tp2_and_tp1(results):
    for r in results:
        a2, a1 = r["agreement_tp2"], r["agreement_tp1"]
        assert a2["top1"] == [a2["top1_gathered"]]  # vocabulary-parallel argmax == argmax of the gathered logits
        assert a1["top1"] == [a1["top1_gathered"]]
        assert 0.5 < a2["top1"][0] < 1.0, a2  # the bf16 copy: most positions agree, not all
        assert abs(a2["top1"][0] - a1["top1"][0]) <= 2 / 64, (a2, a1)  # bf16 sums in another order: a near tie
        assert a2["generated"].shape == (2, 4)
        assert torch.equal(a2["generated"], a1["generated"])
        assert torch.equal(a2["generated"], results[0]["agreement_tp2"]["generated"])  # every rank alike


def test_ddp_and_optimizer_hold_the_student_only_and_gradients_reach_it_only(results):
    for r in results:
        t = r["training"]
        assert not t["teacher_in_ddp"]
        assert t["unwrapped_is_student"]
        assert t["ddp_numel"] == t["student_numel"]
        assert t["opt_numel"] <= t["student_numel"]  # the distributed optimizer holds this rank's shard
        assert all(math.isfinite(x) for x in t["losses"])
        assert t["teacher_unchanged"]
        assert not t["teacher_grads"]
        assert t["student_changed"] >= t["student_params"] - 1  # (a vocabulary shard may see no token)


def test_default_recipe_trains_the_expert_weights_with_warmup_and_decay(results):
    for r in results:
        t = r["recipe"]
        recipe = t["recipe"]
        # the optimizer holds (its shard of) the experts' weights alone
        assert 0 < t["opt_numel"] <= t["expert_numel"] < t["student_numel"], t
        assert t["stub_optimizers"] == 0  # no empty dense optimizer: its checkpoint save fails in Megatron 0.19
        assert all(grad == (".experts." in n) for n, grad in t["requires_grad"].items())
        assert t["counts"]["experts"] > 0
        assert all(v == 0 for g, v in t["counts"].items() if g != "experts")
        lrs, warmup = t["lrs"], recipe.warmup_steps(20)
        assert warmup == 1
        assert lrs[0] == 0.0
        assert lrs[warmup] == pytest.approx(recipe.lr)
        assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1:], strict=False))  # decays
        assert lrs[-1] == pytest.approx(recipe.min_lr)
        assert t["betas"] == (recipe.adam_beta1, recipe.adam_beta2)
