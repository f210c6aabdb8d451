"""Virtual pipeline stages on 4 gloo ranks (one spawn): TP=2 x PP=2 x VPP=2 (two model chunks per stage, each one
layer of 4: stage 0 holds layers 0 and 2, stage 1 layers 1 and 3) against TP=2 x PP=1 on the same weights and tokens.

* ``mtq.quantize(chunks, config, forward_loop)`` calibrates every chunk in one pass of Megatron's interleaved schedule
  (forward only): the expert amaxes of every layer, under global names, equal those of the one-stage model.
* ``get_forward_backward_func`` with the list of chunks (the interleaved 1F1B schedule): the forward-only losses give
  those of PP=1; trained the way Megatron-LM trains chunks (each in ``Float16Module`` + its own
  ``DistributedDataParallel``, one ``get_megatron_optimizer`` with bf16 and the distributed optimizer over the list,
  two steps of 4 micro-batches), the losses and trained weights are those of PP=1 trained the same way.
* Training at two stages with Megatron's default ``batch_p2p_comm=True`` (which pairs activations with gradients
  there) is refused by name.
* ``save_sharded_checkpoint(chunks)`` restores bit-exact at PP=1 and at PP=2 without virtual stages; checkpoints
  saved there restore bit-exact into chunks again.
* ``training.setup_training(chunks)`` + ``train`` (one DDP per chunk, one optimizer) give the losses and the weights
  of Megatron's own wrappers above, bit for bit; given one chunk, or the chunks out of order, it refuses by name.
* QAD of quantized student chunks against teacher chunks (the teacher's hidden states stacked on the batch axis
  between stages): the forward-only losses through the drop-in schedule, two training steps of
  ``setup_training(chunks)`` + ``train`` (losses and trained students; through Megatron's schedule and through the
  drop-in one) and the forward-only losses with a teacher
  stored in FP8 are those of PP=1; a teacher of another hidden size or another ``vp_stage`` is refused by name
  (Hugging Face export and import: test_pipeline_export.py).
"""

import math
import re

import pytest
import torch
from limits import seconds  # noqa: E402
from megatron_harness.ranks import errors_of, merged_across_ranks  # noqa: E402

from modelopt_moe.launch import spawn

WORLD, SEED, LAYERS, SEQ, MB, STEPS, MICRO = 4, 1234, 4, 32, 2, 2, 4


def _tensors(chunks) -> dict:
    """Every tensor of the chunks' state dicts by (TP rank, global layer name)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    out = {}
    for chunk in chunks:
        offset = get_transformer_layer_offset(chunk.config, vp_stage=chunk.vp_stage) if pp > 1 else 0

        def rename(m, offset=offset):
            return f"decoder.layers.{int(m.group(1)) + offset}."

        for n, t in chunk.state_dict().items():
            if isinstance(t, torch.Tensor):
                out[(tp_rank, re.sub(r"decoder\.layers\.(\d+)\.", rename, n))] = t.detach().clone()
    return out


def _build(mm, pp: int, vpp: int | None, seed: int, dtype: torch.dtype = torch.float32) -> list:
    """This rank's model chunks at TP=2 and the given pipeline layout (one chunk without virtual stages)."""
    mm.init_model_parallel(2, 1, pp=pp, vpp=vpp, seed=SEED)
    return _chunks(mm, vpp, seed, dtype)


def _chunks(mm, vpp: int | None, seed: int, dtype: torch.dtype = torch.float32) -> list:
    """More model chunks at the layout already initialised (one without virtual stages)."""
    if vpp is None:
        return [mm.build_moe_gpt(seed=seed, num_layers=LAYERS, params_dtype=dtype)]
    return [mm.build_moe_gpt(seed=seed, num_layers=LAYERS, vp_stage=v, params_dtype=dtype) for v in range(vpp)]


def _run(chunks, batches, forward_only: bool) -> list[float]:
    """One call of the drop-in schedule over the chunks (one data iterator per chunk): the reported losses."""
    from modelopt_moe.plugins.megatron import get_forward_backward_func, lm_forward_step
    from modelopt_moe.plugins.megatron_cpu import megatron_training_shims

    with megatron_training_shims():
        reported = get_forward_backward_func()(
            forward_step_func=lm_forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
            num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MB, forward_only=forward_only)
    return [float(r["lm loss"]) for r in reported]


def _train(chunks, batches, steps: int, microbatches: int) -> list[float | None]:
    """Megatron's way of training model chunks: each chunk in ``Float16Module`` + its own DDP (bucketing on the
    first chunk only, as Megatron-LM's ``get_model`` wraps virtual pipeline chunks), one ``get_megatron_optimizer``
    (Adam, bf16 with fp32 main parameters, the distributed optimizer) over the list, ``finalize_model_grads`` and the
    loss scale in the config; ``steps`` steps of ``microbatches`` micro-batches each through the drop-in schedule.
    The mean loss of every step (None off the last stage)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from modelopt_moe.plugins.megatron import get_forward_backward_func, lm_forward_step
    from modelopt_moe.plugins.megatron_cpu import megatron_training_shims

    config = chunks[0].config
    for c in chunks:  # bf16 activations between the stages too, as Megatron-LM's arguments set them
        c.config.bf16, c.config.pipeline_dtype = True, torch.bfloat16
        if len(chunks) > 1:  # Megatron-LM's p2p setting at virtual stages (batched, two stages pair them wrongly)
            c.config.overlap_p2p_comm, c.config.batch_p2p_comm = True, False
    with megatron_training_shims():
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
        model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=Float16Module(config, c),
                                         disable_bucketing=i > 0) for i, c in enumerate(chunks)]
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, bf16=True,
                                                           params_dtype=torch.bfloat16, use_distributed_optimizer=True,
                                                           clip_grad=1.0), model)
    for c in chunks:
        c.config.finalize_model_grads_func = finalize_model_grads
        c.config.grad_scale_func = optimizer.scale_loss
    schedule = get_forward_backward_func()
    losses = []
    for step in range(steps):
        step_batches = batches[step * microbatches:(step + 1) * microbatches]
        with megatron_training_shims():
            for m in model:
                m.train()
                m.zero_grad_buffer()
            optimizer.zero_grad()
            reported = schedule(forward_step_func=lm_forward_step, data_iterator=[iter(step_batches) for _ in model],
                                model=model, num_microbatches=microbatches, seq_length=SEQ, micro_batch_size=MB,
                                forward_only=False)
            updated, _, _ = optimizer.step()
        assert updated, f"step {step}: the optimizer skipped the update"
        losses.append(sum(float(r["lm loss"]) for r in reported) / len(reported) if reported else None)
    return losses


def _quantize_fp8(mm, chunks):
    """``mtq.quantize`` of the chunks with static FP8 experts, calibrated through the drop-in schedule (forward
    only): the list it returns."""
    import warnings

    from megatron_harness.configs import expert_quant_config

    import modelopt_moe.quantization as mtq

    calib = mm.text_batches(MB, SEQ, 2, offset=100)

    def forward_loop(model):
        with torch.no_grad():
            _run(model, calib, forward_only=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mtq.quantize(chunks, expert_quant_config("fp8", "static"), forward_loop)


def _layout(mm, pp: int, vpp: int | None, ckpt: str | None, helper: bool = False) -> dict:
    """Quantize, calibrate and train this layout's chunks (``helper``: through ``setup_training`` and ``train``),
    then save them to ``ckpt``."""
    from modelopt_moe.plugins.megatron import save_sharded_checkpoint
    from modelopt_moe.plugins.megatron import training as mt
    from modelopt_moe.quantization.chunk_names import global_name_of
    from modelopt_moe.quantization.quant_module import named_quantizers

    chunks = _build(mm, pp, vpp, SEED)
    batches = mm.text_batches(MB, SEQ, STEPS * MICRO)
    returned = _quantize_fp8(mm, chunks)
    amax = {global_name_of(c)(n): q.amax.detach().clone() for c in chunks for n, q, _ in named_quantizers(c)
            if getattr(q, "amax", None) is not None}
    with torch.no_grad():
        forward_losses = _run(chunks, batches[:2], forward_only=True)
    if helper:
        trainer = mt.setup_training(chunks, lr=1e-3)
        losses = mt.train(trainer, batches, steps=STEPS, num_microbatches=MICRO)
        return {"losses": losses, "tensors": _tensors(chunks), "wrapped": [type(m).__name__ for m in trainer.model],
                "unwrapped": all(a is b for a, b in zip(mt.unwrap(trainer.model), chunks, strict=True))}
    losses = _train(chunks, batches, STEPS, MICRO)
    save_sharded_checkpoint(chunks, ckpt)
    return {"same_list": returned is chunks, "amax": amax, "forward_losses": forward_losses, "losses": losses,
            "tensors": _tensors(chunks), "layers": [len(c.decoder.layers) for c in chunks]}


def _reload(mm, pp: int, vpp: int | None, src: str, dst: str | None) -> dict:
    """Fresh chunks (other weights) at this layout restored from ``src`` (then saved to ``dst``): their tensors."""
    from modelopt_moe.plugins.megatron import load_sharded_checkpoint, save_sharded_checkpoint

    chunks = _build(mm, pp, vpp, SEED + 7, torch.bfloat16)  # as trained (Float16Module made them bf16)
    load_sharded_checkpoint(chunks, src)
    if dst is not None:
        save_sharded_checkpoint(chunks, dst)
    return _tensors(chunks)


def _qad(mm, pp: int, vpp: int | None, dropin: bool = False) -> dict:
    """QAD of this layout's quantized student chunks against teacher chunks of other weights (built at the same
    layout): forward-only losses through the drop-in schedule, then two steps of ``setup_training(chunks)`` +
    ``train`` (Megatron's own schedule; ``dropin``: the drop-in one, reusing fake-quantized weights); then the
    forward-only losses of a teacher stored in FP8."""
    from modelopt_moe.plugins.megatron import distillation_model
    from modelopt_moe.plugins.megatron import training as mt

    students = _build(mm, pp, vpp, SEED, torch.bfloat16)
    teachers = [t.eval() for t in _chunks(mm, vpp, SEED + 1, torch.bfloat16)]
    batches = mm.text_batches(MB, SEQ, STEPS * MICRO)
    _quantize_fp8(mm, students)
    models = [distillation_model(s, t) for s, t in zip(students, teachers, strict=True)]
    with torch.no_grad():
        forward_losses = _run(models, batches[:MICRO], forward_only=True)
    trainer = mt.setup_training(models, lr=1e-3, reuse_quantized_weights=dropin)
    losses = mt.train(trainer, batches, steps=STEPS, num_microbatches=MICRO)
    fp8_teachers = [t.eval() for t in _chunks(mm, vpp, SEED + 1, torch.bfloat16)]
    models = [distillation_model(s, t, teacher_fp8="per_tensor") for s, t in zip(students, fp8_teachers, strict=True)]
    with torch.no_grad():
        fp8_losses = _run(models, batches[:MICRO], forward_only=True)
    return {"forward_losses": forward_losses, "losses": losses, "fp8_forward_losses": fp8_losses,
            "kinds": [type(m).__name__ for m in models], "tensors": _tensors(students)}


def _refusals(mm) -> dict:
    """QAD, setup_training given one chunk or the chunks out of order, and training with batched p2p at virtual
    pipeline stages: the error each raises."""
    from modelopt_moe.plugins.megatron import distillation_model, get_forward_backward_func, lm_forward_step
    from modelopt_moe.plugins.megatron.training import setup_training
    from modelopt_moe.plugins.megatron_cpu import megatron_training_shims

    chunks = _build(mm, 2, 2, SEED)
    batches = mm.text_batches(MB, SEQ, 4)

    def train_with_batched_p2p():  # Megatron's default config: batch_p2p_comm=True
        with megatron_training_shims():
            get_forward_backward_func()(forward_step_func=lm_forward_step, model=chunks,
                                        data_iterator=[iter(batches) for _ in chunks], num_microbatches=4,
                                        seq_length=SEQ, micro_batch_size=MB, forward_only=False)

    teachers = _chunks(mm, 2, SEED + 1)
    wide = mm.build_moe_gpt(seed=SEED + 1, num_layers=LAYERS, hidden=128, vp_stage=0)
    calls = {
        "qad_other_hidden_size": lambda: distillation_model(chunks[0], wide),
        "qad_other_vp_stage": lambda: distillation_model(chunks[0], teachers[1]),
        "setup_training": lambda: setup_training(chunks[0]),
        "setup_training_order": lambda: setup_training(chunks[::-1]),
        "batched_p2p": train_with_batched_p2p,
    }
    return errors_of(calls)


def _worker(rank, world_size, root):
    import megatron_harness.models as mm

    out = {"vpp": _layout(mm, 2, 2, f"{root}/vpp"), "pp1": _layout(mm, 1, None, f"{root}/pp1_trained"),
           "vpp_helper": _layout(mm, 2, 2, None, helper=True), "qad_vpp": _qad(mm, 2, 2),
           "qad_vpp_dropin": _qad(mm, 2, 2, dropin=True), "qad_pp1": _qad(mm, 1, None)}
    out["vpp_at_pp1"] = _reload(mm, 1, None, f"{root}/vpp", f"{root}/pp1")
    out["vpp_at_pp2"] = _reload(mm, 2, None, f"{root}/vpp", f"{root}/pp2")
    out["pp1_at_vpp"] = _reload(mm, 2, 2, f"{root}/pp1", None)
    out["pp2_at_vpp"] = _reload(mm, 2, 2, f"{root}/pp2", None)
    out["refusals"] = _refusals(mm)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("vpp")
    return {"results": spawn(_worker, WORLD, args=(str(root),), timeout=seconds(600)), "root": root}


def _merged(results, *keys) -> dict:
    """Every rank's ``result[key][...]`` dict of tensors (keyed by TP rank and global name) merged into one."""
    out = {}
    for r in results:
        part = r
        for key in keys:
            part = part[key]
        out.update(part)
    return out


def _assert_trained_as(results, layout: str, reference: str) -> None:
    """Every rank's trained tensors of ``layout`` equal those of ``reference`` (another pipeline layout) to fp32
    rounding."""
    expected = _merged(results, reference, "tensors")
    for r in results:
        for key, t in r[layout]["tensors"].items():
            torch.testing.assert_close(t, expected[key], rtol=1e-4, atol=1e-6, msg=str(key))


def test_calibration_through_the_interleaved_schedule_gives_the_amaxes_of_pp1(run):
    results = run["results"]
    pp1 = results[0]["pp1"]["amax"]
    assert pp1
    assert all(".experts." in n for n in pp1)
    for r in results:
        assert r["vpp"]["same_list"]
        assert r["vpp"]["layers"] == [1, 1]  # 4 layers on 2 stages x 2 chunks
    merged = merged_across_ranks(r["vpp"]["amax"] for r in results)  # TP ranks of one stage agree
    assert sorted(merged) == sorted(pp1)  # every chunk's layer, under its global name
    for n, a in pp1.items():
        assert torch.equal(merged[n], a), n


def test_interleaved_schedule_losses_equal_pp1_on_the_same_weights_and_tokens(run):
    results = run["results"]
    pp1 = results[0]["pp1"]
    assert len(pp1["forward_losses"]) == 2
    assert len(pp1["losses"]) == 2
    assert all(math.isfinite(x) for x in pp1["losses"])
    assert pp1["losses"][1] != pp1["losses"][0]  # the first step trained
    last = [i for i, r in enumerate(results) if r["vpp"]["forward_losses"]]
    assert len(last) == 2  # the losses come from the 2 TP ranks of the last stage
    for i, r in enumerate(results):
        if i in last:
            assert r["vpp"]["forward_losses"] == pytest.approx(pp1["forward_losses"], rel=1e-5, abs=1e-6)
            assert r["vpp"]["losses"] == pytest.approx(pp1["losses"], rel=1e-5, abs=1e-6)
        else:
            assert r["vpp"]["losses"] == [None, None]
    _assert_trained_as(results, "vpp", "pp1")  # the trained weights too


def test_checkpoint_of_chunks_restores_bit_exact_at_pp1_and_pp2_and_back(run):
    saved = _merged(run["results"], "vpp", "tensors")
    assert any("_amax" in n for _, n in saved)  # the quantizers' amaxes travel too
    assert any(n.startswith("decoder.layers.3.") for _, n in saved)
    for layout in ("vpp_at_pp1", "vpp_at_pp2", "pp1_at_vpp", "pp2_at_vpp"):
        got = _merged(run["results"], layout)
        assert sorted(got) == sorted(saved), layout
        for key, t in saved.items():
            assert torch.equal(got[key], t), (layout, key)


def test_training_at_two_stages_with_batched_p2p_is_refused_before_it_pairs_activations_with_gradients(run):
    for r in run["results"]:
        error = r["refusals"]["batched_p2p"]
        assert error is not None, "trained with batch_p2p_comm=True at pipeline size 2 (wrong losses, no error)"
        assert error.startswith("ValueError: forward_backward_func: "), error
        assert "pipeline_model_parallel_size=2 needs config.batch_p2p_comm=False (found True)" in error, error
        assert "overlap_p2p_comm=True" in error, error


def test_setup_training_of_the_chunks_trains_as_megatrons_own_wrappers(run):
    results = run["results"]
    last = [r["vpp"]["losses"] for r in results if r["vpp"]["losses"][0] is not None][0]
    for r in results:
        helper = r["vpp_helper"]
        assert helper["wrapped"] == ["DistributedDataParallel"] * 2
        assert helper["unwrapped"]
        assert helper["losses"] == pytest.approx(last, rel=1e-6)  # every stage reports the last stage's losses
        for key, t in r["vpp"]["tensors"].items():
            assert torch.equal(helper["tensors"][key], t), key


def test_qad_at_virtual_pipeline_stages_gives_the_losses_of_pp1(run):
    results = run["results"]
    pp1 = results[0]["qad_pp1"]
    assert len(pp1["forward_losses"]) == MICRO
    assert len(pp1["losses"]) == STEPS
    assert all(math.isfinite(x) and x > 1e-3 for x in pp1["losses"])  # two different models: a real KL
    assert pp1["losses"][1] != pp1["losses"][0]  # the first step trained the student
    assert pp1["fp8_forward_losses"] != pp1["forward_losses"]  # the FP8 teacher is another teacher
    last = [i for i, r in enumerate(results) if r["qad_vpp"]["forward_losses"]]
    assert len(last) == 2  # the KL is computed on the 2 TP ranks of the last stage
    for i, r in enumerate(results):
        vpp = r["qad_vpp"]
        assert vpp["kinds"] == ["PipelineDistillationModel"] * 2
        assert vpp["losses"] == pytest.approx(pp1["losses"], rel=1e-5, abs=1e-6)  # every stage reports them
        assert r["qad_vpp_dropin"]["losses"] == vpp["losses"]  # train_step through the drop-in schedule
        if i in last:
            assert vpp["forward_losses"] == pytest.approx(pp1["forward_losses"], rel=1e-5, abs=1e-6)
            assert vpp["fp8_forward_losses"] == pytest.approx(pp1["fp8_forward_losses"], rel=1e-5, abs=1e-6)
        else:
            assert vpp["forward_losses"] == vpp["fp8_forward_losses"] == []
    _assert_trained_as(results, "qad_vpp", "qad_pp1")  # the trained students too


def test_qad_refuses_a_teacher_that_cannot_stack_on_the_batch_axis_and_the_helper_takes_only_the_list_of_chunks(run):
    for r in run["results"]:
        errors = r["refusals"]
        assert errors["qad_other_hidden_size"] == (
            "ValueError: distillation_model: teacher.config.hidden_size=128 but student.config.hidden_size=64; at "
            "virtual pipeline stages the teacher's hidden states travel stacked on the batch axis of the student's "
            "[seq, micro_batch, hidden_size] tensors (Megatron's interleaved schedule sizes them from the student's "
            "config), so the teacher needs the student's hidden size; distil a teacher of another width with "
            "virtual_pipeline_model_parallel_size=None")
        assert errors["qad_other_vp_stage"] == (
            "ValueError: distillation_model: student.vp_stage=0 but teacher.vp_stage=1; pass the teacher's chunk of "
            "the same virtual pipeline stage")
        assert errors["setup_training"] is not None, "setup_training accepted one model at virtual pipeline stages"
        assert "virtual_pipeline_model_parallel_size=2, expected None or 1" in errors["setup_training"]
        assert "pass the list of the 2 chunks built with vp_stage=0..1" in errors["setup_training"]
        assert errors["setup_training_order"] == (
            "ValueError: setup_training: model chunk 0 has vp_stage=1, expected 0 (the chunks in the order of their "
            "virtual pipeline stages)")
