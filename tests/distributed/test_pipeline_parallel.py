"""Pipeline parallelism on 4 gloo ranks (one spawn): PP=2 x TP=2 against PP=1 x TP=2 on the same weights and tokens.

* Calibration through Megatron's pipeline schedule (forward only): every stage's expert amaxes, per layer, equal
  those of the one-stage model (layers live on one stage: no reduction over the pipeline).
* QAD: ``distillation_model(student, teacher)`` with the teacher split on the same stages, trained by ``train`` (the
  non-interleaved schedule; the hidden states of both models go between the stages), gives the losses of PP=1, and
  the KL is computed on the last stage only.
* ``save_sharded_checkpoint`` at PP=2 restores bit-exact at PP=1 (every stage's layers, their amaxes and quantization
  state), and that saved again at PP=1 restores bit-exact at PP=2.
"""

import math
import re

import pytest
import torch
from limits import seconds  # noqa: E402
from megatron_harness.ranks import merged_across_ranks  # noqa: E402

from modelopt_moe.launch import spawn

WORLD, SEED = 4, 1234


def _global_layer(name: str, offset: int) -> str:
    return re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)


def _tensors(model) -> dict:
    """Every tensor of the model's state dict by (TP rank, global layer name)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    offset = get_transformer_layer_offset(model.config) if pp > 1 else 0
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    return {(tp_rank, _global_layer(n, offset)): t.detach().clone() for n, t in model.state_dict().items()
            if isinstance(t, torch.Tensor)}


def _reload(mm, pp: int, src: str, dst: str | None) -> dict:
    """A fresh model at pipeline size ``pp`` (TP=2) restored from ``src`` (then saved to ``dst``): its tensors."""
    from modelopt_moe.plugins.megatron import load_sharded_checkpoint, save_sharded_checkpoint

    mm.init_model_parallel(2, 1, pp=pp, seed=SEED)
    model = mm.build_moe_gpt(seed=SEED + 7, num_layers=4, params_dtype=torch.bfloat16)  # other weights
    load_sharded_checkpoint(model, src)
    if dst is not None:
        save_sharded_checkpoint(model, dst)
    return _tensors(model)


def _layout(mm, mt, pp: int, ckpt_root: str) -> dict:
    import warnings

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from megatron_harness.configs import expert_quant_config

    import modelopt_moe.quantization as mtq
    from modelopt_moe.plugins.megatron import distillation_model, lm_forward_step, save_sharded_checkpoint
    from modelopt_moe.plugins.megatron import get_forward_backward_func as dropin_schedule
    from modelopt_moe.plugins.megatron_cpu import megatron_training_shims
    from modelopt_moe.quantization.quant_module import named_quantizers

    mm.init_model_parallel(2, 1, pp=pp, seed=SEED)
    calib = mm.text_batches(2, 32, 2, offset=100)
    batches = mm.text_batches(2, 32, 4)

    def forward_loop(model):
        with megatron_training_shims(), torch.no_grad():
            get_forward_backward_func()(forward_step_func=lm_forward_step, data_iterator=iter(calib), model=[model],
                                        num_microbatches=len(calib), seq_length=32, micro_batch_size=2,
                                        forward_only=True)

    student = mm.build_moe_gpt(seed=SEED, num_layers=4, params_dtype=torch.bfloat16)
    teacher = mm.build_moe_gpt(seed=SEED + 1, num_layers=4, params_dtype=torch.bfloat16).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(student, expert_quant_config("fp8", "static"), forward_loop)
    offset = get_transformer_layer_offset(student.config) if pp > 1 else 0
    amax = {_global_layer(n, offset): q.amax.detach().clone() for n, q, _ in named_quantizers(student)
            if getattr(q, "amax", None) is not None}
    model = distillation_model(student, teacher)
    with megatron_training_shims(), torch.no_grad():  # the drop-in schedule passes the wider tensor shapes itself
        reported = dropin_schedule()(forward_step_func=lm_forward_step, data_iterator=iter(batches[:2]),
                                     model=[model], num_microbatches=2, seq_length=32, micro_batch_size=2,
                                     forward_only=True)
    forward_losses = [float(r["lm loss"]) for r in reported]
    trainer = mt.setup_training(model, lr=1e-3)
    losses = mt.train(trainer, batches, steps=2, num_microbatches=2)
    last_stage = parallel_state.is_pipeline_last_stage()
    refusals = {}
    if pp > 1:  # the trained student, saved at PP=2
        save_sharded_checkpoint(student, f"{ckpt_root}/pp2")
    tensors = _tensors(student)
    if pp > 1:  # virtual pipeline stages: a model built without vp_stage is no model chunk
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                                 virtual_pipeline_model_parallel_size=2)
        try:
            distillation_model(student, teacher)
        except ValueError as e:
            refusals["virtual"] = str(e)
    return {"refusals": refusals, "forward_losses": forward_losses, "tensors": tensors, "amax": amax, "losses": losses,
            "kind": type(model).__name__, "last_stage": last_stage, "layers": len(student.decoder.layers)}


def _worker(rank, world_size, ckpt_root):
    import megatron_harness.models as mm

    from modelopt_moe.plugins.megatron import training as mt

    out = {"pp2": _layout(mm, mt, 2, ckpt_root), "pp1": _layout(mm, mt, 1, ckpt_root)}
    out["pp2_at_pp1"] = _reload(mm, 1, f"{ckpt_root}/pp2", f"{ckpt_root}/pp1")
    out["back_at_pp2"] = _reload(mm, 2, f"{ckpt_root}/pp1", None)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn(_worker, WORLD, args=(str(tmp_path_factory.mktemp("pp")),), timeout=seconds(600))


def test_amaxes_at_pp2_equal_pp1_and_cover_every_stage(results):
    pp1 = results[0]["pp1"]["amax"]
    assert pp1
    assert all(".experts." in n for n in pp1)
    for r in results:
        assert r["pp2"]["layers"] == 2  # 4 layers on 2 stages
    merged = merged_across_ranks(r["pp2"]["amax"] for r in results)  # TP ranks of one stage agree
    assert sorted(merged) == sorted(pp1)  # every stage's layers, under their global names
    for n, a in pp1.items():
        assert torch.equal(merged[n], a), n


def test_qad_loss_at_pp2_equals_pp1_on_the_same_weights_and_tokens(results):
    pp1 = results[0]["pp1"]["losses"]
    assert len(pp1) == 2
    assert all(math.isfinite(x) and x > 1e-3 for x in pp1)  # two different models: a real KL
    assert pp1[1] != pp1[0]  # the first step trained the student
    for r in results:
        assert r["pp2"]["kind"] == "PipelineDistillationModel"
        assert r["pp2"]["losses"] == pytest.approx(pp1, rel=1e-5, abs=1e-6), (r["pp2"]["losses"], pp1)
        assert r["pp1"]["losses"] == pp1
    assert sum(r["pp2"]["last_stage"] for r in results) == 2  # the KL is computed on the 2 last-stage TP ranks
    for r in results:  # modelopt_moe's get_forward_backward_func: the same losses, on the last stage alone
        assert len(r["pp1"]["forward_losses"]) == 2
        assert r["pp1"]["forward_losses"] == pytest.approx(results[0]["pp1"]["forward_losses"])
        if r["pp2"]["last_stage"]:
            assert r["pp2"]["forward_losses"] == pytest.approx(r["pp1"]["forward_losses"], rel=1e-5, abs=1e-6)
        else:
            assert r["pp2"]["forward_losses"] == []
        assert sum(r["pp1"]["forward_losses"]) / 2 == pytest.approx(pp1[0], rel=1e-5)  # the first step's loss


def test_checkpoint_at_pp2_restores_bit_exact_at_pp1_and_back(results):
    saved, at_pp1, back = {}, {}, {}
    for r in results:
        saved.update(r["pp2"]["tensors"])
        at_pp1.update(r["pp2_at_pp1"])
        back.update(r["back_at_pp2"])
    assert any("_amax" in n for _, n in saved)  # the quantizers' amaxes travel too
    assert any(n.startswith("decoder.layers.3.") for _, n in saved)  # every stage's layers
    assert sorted(at_pp1) == sorted(saved)
    assert sorted(back) == sorted(saved)
    for key, t in saved.items():
        assert torch.equal(at_pp1[key], t), key
        assert torch.equal(back[key], t), key


def test_virtual_pipeline_stages_are_refused_by_name(results):
    for r in results:
        assert "virtual pipeline stages (2) are not supported" in r["pp2"]["refusals"]["virtual"]
