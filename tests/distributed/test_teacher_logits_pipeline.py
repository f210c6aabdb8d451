"""Precomputed teacher logits at pipeline parallelism 2, on 4 gloo ranks (one spawn): PP=2 x TP=2 against
PP=1 x TP=2 on the same teacher weights, student weights and batches.

* ``write_teacher_logits`` at PP=2 runs the teacher through Megatron's pipeline schedule (forward only): the last
  stage's first TP rank writes the store, whose shards are byte for byte those PP=1 writes and whose manifest differs
  only in the data-parallel size of the layout; a ``top_k`` above the vocabulary fails on every rank (the first stage
  names the failing ranks) and writes nothing; batches the pipeline cannot run (another shape, token ids outside the
  vocabulary) are refused on every rank before the teacher runs.
* QAD from the stored logits at PP=2 (``distillation_model(student, stored_teacher_logits(...))``: the student alone
  on every stage, the KL on the last), two steps of 4 micro-batches through ``setup_training`` (Float16Module + DDP +
  bf16 + the distributed optimizer) and the drop-in schedule, gives the losses and trained weights of PP=1 from its
  store; the tensors between the stages keep Megatron's usual shapes. So does PP=2 x VPP=2 (one model per student
  chunk) from the PP=2 store; writing at virtual stages is refused by name.
* A missing or damaged store fails on every rank by name, before any step; a forward step that gives the last stage
  no tokens is refused by name.
"""

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn

WORLD, SEED, K, LAYERS, SEQ, MB, STEPS, MICRO = 4, 1234, 16, 4, 32, 2, 2, 4


def _tensors(chunks: list) -> dict:
    """Every tensor of the model chunks' state dicts by (TP rank, global layer name)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    out = {}
    for chunk in chunks:
        offset = get_transformer_layer_offset(chunk.config, vp_stage=chunk.vp_stage) if pp > 1 else 0
        rename = lambda m, offset=offset: f"decoder.layers.{int(m.group(1)) + offset}."  # noqa: E731
        out.update({(tp_rank, re.sub(r"decoder\.layers\.(\d+)\.", rename, n)): t.detach().clone()
                    for n, t in chunk.state_dict().items() if isinstance(t, torch.Tensor)})
    return out


def _error(call) -> str | None:
    try:
        call()
    except Exception as e:  # noqa: BLE001  (the test names the kind)
        return f"{type(e).__name__}: {e}"
    return None


def _student(mm, vpp: int | None = None) -> list:
    """The student's chunks at the current layout (one without virtual stages): static FP8 experts calibrated through
    the pipeline schedule."""
    import warnings

    from megatron_harness.configs import expert_quant_config

    import modelopt_moe.quantization as mtq
    from modelopt_moe.plugins.megatron import get_forward_backward_func, lm_forward_step
    from modelopt_moe.plugins.megatron_cpu import megatron_training_shims

    calib = mm.text_batches(MB, SEQ, 2, offset=100)

    def forward_loop(chunks):
        with megatron_training_shims(), torch.no_grad():
            get_forward_backward_func()(forward_step_func=lm_forward_step, model=chunks,
                                        data_iterator=[iter(calib) for _ in chunks], num_microbatches=len(calib),
                                        seq_length=SEQ, micro_batch_size=MB, forward_only=True)

    chunks = [mm.build_moe_gpt(seed=SEED, num_layers=LAYERS, params_dtype=torch.bfloat16, vp_stage=v)
              for v in (range(vpp) if vpp else [None])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(chunks, expert_quant_config("fp8", "static"), forward_loop)
    return chunks


def _layout(mm, pp: int, root: Path) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from modelopt_moe.plugins.megatron import (
        distillation_model,
        distillation_tensor_shapes_fn,
        stored_teacher_logits,
        write_teacher_logits,
    )
    from modelopt_moe.plugins.megatron import training as mt

    mm.init_model_parallel(2, 1, pp=pp, seed=SEED)
    batches = mm.text_batches(MB, SEQ, STEPS * MICRO)
    teacher = mm.build_moe_gpt(seed=SEED + 1, num_layers=LAYERS, params_dtype=torch.bfloat16).eval()
    directory = root / f"pp{pp}"
    path = write_teacher_logits(teacher, batches, directory, top_k=K, batches_per_shard=4)
    out = {"path": str(path), "last_stage": parallel_state.is_pipeline_last_stage(),
           "written": sorted(p.name for p in directory.iterdir())}
    # top_k above the vocabulary: found on the last stage, every rank stops, nothing written
    out["too_large_k"] = _error(lambda: write_teacher_logits(teacher, batches, root / f"k{pp}", top_k=1000))
    if pp > 1:  # batches the pipeline cannot run: refused on every rank before the teacher runs
        bad = [dict(b) for b in batches]
        bad[1]["tokens"] = bad[1]["tokens"].clone().fill_(999)
        out["bad_tokens"] = _error(lambda: write_teacher_logits(teacher, bad, root / "bad", top_k=K))
        out["bad_shape"] = _error(lambda: write_teacher_logits(teacher, batches + mm.text_batches(1, SEQ, 1), root /
                                                               "bad", top_k=K))
    out["too_large_k_wrote"] = sorted(p.name for p in (root / f"k{pp}").glob("*"))  # hidden temporaries too
    forwards = []
    teacher.register_forward_pre_hook(lambda *a: forwards.append(1))

    student = _student(mm)
    model = distillation_model(student[0], stored_teacher_logits(directory, batches=batches))
    out["kind"], out["shapes_fn"] = type(model).__name__, distillation_tensor_shapes_fn(model)
    trainer = mt.setup_training(model, lr=1e-3, reuse_quantized_weights=True)  # the drop-in schedule
    out["losses"] = mt.train(trainer, batches, steps=STEPS, num_microbatches=MICRO)
    out["tensors"], out["teacher_forwards"] = _tensors(student), len(forwards)

    if pp > 1:  # a missing or damaged store, in the calls of a training script: every rank stops before any step
        damaged = root / "damaged"
        if dist.get_rank() == 0:
            shutil.copytree(directory, damaged)
            shard = damaged / "dp00000-of-00001" / "shard-00001.pt"
            shard.write_bytes(shard.read_bytes()[:100])
        dist.barrier()

        def train_from(where):
            model = distillation_model(_student(mm)[0], stored_teacher_logits(where, batches=batches))
            mt.train(mt.setup_training(model, lr=1e-3), batches, steps=1, num_microbatches=MICRO)

        out["missing"] = _error(lambda: train_from(root / "missing"))
        out["damaged"] = _error(lambda: train_from(damaged))
        if parallel_state.is_pipeline_last_stage():  # a forward step that passes no tokens to the last stage
            out["no_tokens"] = _error(lambda: model(None, batches[0]["position_ids"], None))
    return out


def _virtual_stages(mm, root: Path) -> dict:
    """PP=2 x VPP=2 (two student chunks of one layer per stage) from the PP=2 store; writing there is refused."""
    from modelopt_moe.plugins.megatron import (
        distillation_micro_batch_size,
        distillation_model,
        stored_teacher_logits,
        write_teacher_logits,
    )
    from modelopt_moe.plugins.megatron import training as mt

    mm.init_model_parallel(2, 1, pp=2, vpp=2, seed=SEED)
    batches = mm.text_batches(MB, SEQ, STEPS * MICRO)
    chunks = _student(mm, vpp=2)
    store = stored_teacher_logits(root / "pp2", batches=batches)
    models = [distillation_model(c, store) for c in chunks]
    trainer = mt.setup_training(models, lr=1e-3, reuse_quantized_weights=True)
    losses = mt.train(trainer, batches, steps=STEPS, num_microbatches=MICRO)
    teacher = [mm.build_moe_gpt(seed=SEED + 1, num_layers=LAYERS, vp_stage=v).eval() for v in range(2)]
    return {"kinds": [type(m).__name__ for m in models], "micro_batch_size": distillation_micro_batch_size(models, MB),
            "losses": losses, "tensors": _tensors(chunks),
            "write": _error(lambda: write_teacher_logits(teacher[0], batches, root / "vpp", top_k=K))}


def _worker(rank, world_size, root):
    import megatron_harness.models as mm

    root = Path(root)
    return {"pp2": _layout(mm, 2, root), "pp1": _layout(mm, 1, root), "vpp": _virtual_stages(mm, root)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("teacher_logits_pp")
    return {"results": spawn(_worker, WORLD, args=(str(root),), timeout=seconds(600)), "root": root}


def test_store_written_at_pp2_holds_the_bytes_of_the_pp1_store(run):
    root, results = run["root"], run["results"]
    pp2, pp1 = root / "pp2" / "dp00000-of-00001", root / "pp1" / "dp00000-of-00002"
    for r in results:
        assert r["pp2"]["path"] == str(pp2)
        assert r["pp2"]["written"] == ["dp00000-of-00001"]  # no leftover temporary directory
        assert r["pp1"]["written"] == ["dp00000-of-00002", "dp00001-of-00002"]
    assert sum(r["pp2"]["last_stage"] for r in results) == 2
    files = sorted(p.name for p in pp2.iterdir())
    assert files == ["manifest.json", "shard-00000.pt", "shard-00001.pt"], files
    assert files == sorted(p.name for p in pp1.iterdir())
    for name in files[1:]:
        assert (pp2 / name).read_bytes() == (pp1 / name).read_bytes(), name
    m2, m1 = (json.loads((d / "manifest.json").read_text()) for d in (pp2, pp1))
    assert m2.pop("data_parallel_size") == 1
    assert m1.pop("data_parallel_size") == 2
    assert m2 == m1
    assert m2["batches"] == STEPS * MICRO
    assert m2["top_k"] == K


def test_a_write_error_on_the_last_stage_stops_every_rank_with_nothing_written(run):
    for r in run["results"]:
        error = r["pp2"]["too_large_k"]
        assert r["pp2"]["too_large_k_wrote"] == r["pp1"]["too_large_k_wrote"] == []
        if r["pp2"]["last_stage"]:
            assert error.startswith("LogitStoreError: teacher logits store "), error
            assert "top_k=1000 exceeds the vocabulary (256)" in error, error
        else:
            assert error == ("LogitStoreError: write_teacher_logits: rank(s) [2, 3] failed before any store was "
                             "committed (their error is raised there); nothing was written"), error
        assert "top_k=1000 exceeds the vocabulary (256)" in r["pp1"]["too_large_k"]
        assert r["pp2"]["bad_tokens"] == (f"LogitStoreError: write_teacher_logits: {run['root'] / 'bad'}: batch 1's "
                                          "tokens hold ids in [999, 999]; the teacher's vocabulary is [0, 256)")
        assert r["pp2"]["bad_shape"] == (f"LogitStoreError: write_teacher_logits: {run['root'] / 'bad'}: batch 8's "
                                         "tokens are [1, 32], batch 0's [2, 32]; with pipeline parallelism every batch "
                                         "is one micro-batch of the schedule, all of one shape")


def test_qad_from_stored_logits_at_pp2_trains_as_pp1(run):
    results = run["results"]
    pp1 = results[0]["pp1"]["losses"]
    assert len(pp1) == STEPS
    assert all(math.isfinite(x) and x > 1e-3 for x in pp1)  # two different models: a real KL
    assert pp1[1] != pp1[0]  # the first step trained the student
    for r in results:
        assert r["pp2"]["kind"] == "PipelineStoredLogitsModel"
        assert r["pp1"]["kind"] == "DistillationModel"
        assert r["pp2"]["shapes_fn"] is None  # the student's hidden states alone go between the stages
        assert r["pp2"]["teacher_forwards"] == r["pp1"]["teacher_forwards"] == 0
        assert r["pp2"]["losses"] == pytest.approx(pp1, rel=1e-5, abs=1e-6), (r["pp2"]["losses"], pp1)
        assert r["pp1"]["losses"] == pp1
    expected = {}
    for r in results:
        expected.update(r["pp1"]["tensors"])
    trained = {}
    for r in results:
        trained.update(r["pp2"]["tensors"])
    assert sorted(trained) == sorted(expected)
    assert any(n.startswith("decoder.layers.3.") for _, n in trained)  # both stages' layers
    for key, t in trained.items():
        torch.testing.assert_close(t, expected[key], rtol=1e-4, atol=1e-6, msg=str(key))


def test_qad_from_stored_logits_at_virtual_pipeline_stages_trains_as_pp1(run):
    results = run["results"]
    expected = {}
    for r in results:
        expected.update(r["pp1"]["tensors"])
    assert sorted(k for r in results for k in r["vpp"]["tensors"]) == sorted(expected)  # every chunk's layers
    for r in results:
        vpp = r["vpp"]
        assert vpp["kinds"] == ["PipelineStoredLogitsModel"] * 2
        assert vpp["micro_batch_size"] == MB  # no teacher hidden states stacked on the batch axis
        assert vpp["losses"] == pytest.approx(results[0]["pp1"]["losses"], rel=1e-5, abs=1e-6)
        for key, t in vpp["tensors"].items():
            torch.testing.assert_close(t, expected[key], rtol=1e-4, atol=1e-6, msg=str(key))
        assert vpp["write"].startswith("ValueError: write_teacher_logits: virtual pipeline stages (2) are not "
                                       "supported"), vpp["write"]


def test_a_missing_or_damaged_store_stops_every_rank_before_any_step(run):
    root = run["root"]
    for r in run["results"]:
        missing, damaged = r["pp2"]["missing"], r["pp2"]["damaged"]
        assert missing.startswith(f"LogitStoreError: teacher logits store {root / 'missing' / 'dp00000-of-00001'}"
                                  "/manifest.json: cannot read the manifest"), missing
        assert damaged == (f"LogitStoreError: teacher logits store {root / 'damaged' / 'dp00000-of-00001'}"
                           "/shard-00001.pt: 100 bytes; the manifest's field 'shards' records "
                           f"{(root / 'pp2' / 'dp00000-of-00001' / 'shard-00001.pt').stat().st_size} bytes"), damaged
        if r["pp2"]["last_stage"]:
            assert r["pp2"]["no_tokens"].startswith("ValueError: distillation_model: the last pipeline stage got "
                                                    "tokens=None as the model's first input"), r["pp2"]["no_tokens"]
            assert "pass the batch's tokens on the last stage too" in r["pp2"]["no_tokens"]
