"""Saving into the wrong directory and loading a checkpoint that does not fit, the way a user's script does it.

Public API only, on 2 gloo ranks (TP=1 x EP=2): Megatron's parallel state and model built with megatron.core and
``modelopt_moe.export.build_megatron_model``, ``mtq.quantize``, ``save_sharded_checkpoint`` /
``load_sharded_checkpoint``, the README's own-calls flow (``restore_sharded_modelopt_state`` +
``dist_checkpointing.load``); ``modelopt_moe.plugins.megatron_cpu`` only makes Megatron run without CUDA.
Every refused call must leave the directories it touched and the model (module classes, parameters, buffers) exactly
as they were. One spawn holds every case; each error is raised on every rank and recorded for the tests below.
"""

import copy
import hashlib
import os
import shutil
import traceback
from functools import partial
from pathlib import Path

import pytest
import torch
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn

WORLD = 2
QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=256, hidden_size=64,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
                 norm_topk_prob=True, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                 tie_word_embeddings=False, torch_dtype="float32")


def model_digest(model) -> str:
    """Module classes, parameters and buffers: any conversion or in-place write changes it."""
    h = hashlib.sha256()
    for name, module in model.named_modules():
        h.update(f"{name}:{type(module).__name__};".encode())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def dir_digest(path) -> str:
    """Every file's name and bytes under ``path`` and the names beside it (a ``<dir>.tmp`` left behind shows)."""
    path = Path(path)
    h = hashlib.sha256(repr(sorted(os.listdir(path.parent))).encode())
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def _outcome(fn) -> str:
    """The error as the user sees it (a BaseException too: torch DCP's CheckpointException is one)."""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - recorded for the assertions
        return "".join(traceback.format_exception(e)) if isinstance(e, Exception) else f"BaseException {e!r}"
    return "no error"


def _worker(rank, world_size, root):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    import modelopt_moe.quantization as mtq
    from modelopt_moe.checkpoint import restore_sharded_modelopt_state, save_sharded_modelopt_state
    from modelopt_moe.export import build_megatron_model
    from modelopt_moe.plugins.megatron import load_sharded_checkpoint, save_sharded_checkpoint
    from modelopt_moe.plugins.megatron_cpu import apply_cpu_shims, megatron_training_shims

    apply_cpu_shims()  # Megatron on a machine without CUDA (a no-op with CUDA)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)

    def build(hidden=64):
        torch.manual_seed(0)
        return build_megatron_model({**QWEN3_MOE, "hidden_size": hidden}, params_dtype=torch.float32).eval()

    def load_with_own_calls(model, ckpt_dir):  # the README's flow
        restore_sharded_modelopt_state([model], ckpt_dir)
        model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt_dir)["model"])

    def on_rank0(fn):
        if rank == 0:
            fn()
        dist.barrier()

    def refused(fn, model, *dirs):
        """The call's outcome, and whether the model and every directory are as before."""
        before = [model_digest(model)] + [dir_digest(d) for d in dirs]
        dist.barrier()
        message = _outcome(fn)
        dist.barrier()
        after = [model_digest(model)] + [dir_digest(d) for d in dirs]
        dist.barrier()
        return message, before == after

    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16).expand(2, 16)
    causal = torch.ones(1, 1, 16, 16, dtype=torch.bool).triu(1)  # True where attention is masked
    src = mtq.quantize(build(), mtq.load_config("fp8_default.yaml"), lambda m: m(tokens, positions, causal))
    out = {}
    ckpt = os.path.join(root, "qat")
    save_sharded_checkpoint([src], ckpt)

    # --- saving into a directory that is not a checkpoint of ours
    hf = os.path.join(root, "hf_model")

    def write_hf():
        os.makedirs(hf)
        for name, text in (("config.json", "{}"), ("model.safetensors.index.json", "{}"),
                           ("model-00001-of-00001.safetensors", "weights")):
            Path(hf, name).write_text(text)

    on_rank0(write_hf)
    out["hf"] = refused(lambda: save_sharded_checkpoint([src], hf), src, hf)
    out["hf_tmp"] = os.path.exists(hf + ".tmp")
    bf16 = os.path.join(root, "megatron_plain")  # Megatron's own checkpoint, without a quantization state
    on_rank0(lambda: os.makedirs(bf16))
    dist_checkpointing.save({"model": build().sharded_state_dict()}, bf16)
    out["plain"] = refused(lambda: save_sharded_checkpoint([src], bf16), src, bf16)
    new = os.path.join(root, "new")
    on_rank0(lambda: (os.makedirs(new + ".tmp"), Path(new + ".tmp", "notes.txt").write_text("mine")))
    out["foreign_tmp"] = refused(lambda: save_sharded_checkpoint([src], new), src, new + ".tmp")
    # --- replacing a checkpoint of ours stays allowed (save_sharded_checkpoint's, and the own-calls flow's)
    own = os.path.join(root, "own")
    on_rank0(lambda: os.makedirs(own))
    dist_checkpointing.save({"model": src.sharded_state_dict()}, own)
    save_sharded_modelopt_state([src], own)
    on_rank0(lambda: shutil.copytree(own, own + "_copy"))
    out["replace_ours"] = _outcome(lambda: (save_sharded_checkpoint([src], ckpt),
                                            save_sharded_checkpoint([src], own + "_copy")))
    dist.barrier()

    # --- a checkpoint of another hidden size: load_sharded_checkpoint and the own-calls flow
    wide = build(96)
    out["wide_load"] = refused(lambda: load_sharded_checkpoint([wide], ckpt), wide, ckpt)
    out["wide_own"] = refused(lambda: load_with_own_calls(wide, own), wide, own)

    # --- a truncated data file in the own-calls flow's checkpoint (no completion marker of ours)
    cut = os.path.join(root, "own_truncated")

    def truncate():
        shutil.copytree(own, cut)
        victim = max(Path(cut).glob("*.distcp"), key=lambda p: p.stat().st_size)
        data = victim.read_bytes()
        victim.write_bytes(data[: len(data) // 2])
        out["cut_file"], out["cut_size"] = victim.name, len(data) // 2

    on_rank0(truncate)
    fresh = build()
    out["cut_own"] = refused(lambda: load_with_own_calls(fresh, cut), fresh, cut)
    out["cut_load"] = refused(lambda: load_sharded_checkpoint([fresh], cut), fresh, cut)

    # --- our checkpoint (its completion marker lists every file) with one data file cut short and another removed
    cut_ours = os.path.join(root, "qat_truncated")

    def truncate_ours():
        shutil.copytree(ckpt, cut_ours)
        short, gone = sorted(Path(cut_ours).glob("*.distcp"))
        data = short.read_bytes()
        short.write_bytes(data[: len(data) // 2])
        gone.unlink()
        out["cut_ours"] = {"short": short.name, "size": len(data) // 2, "needed": len(data), "gone": gone.name}

    on_rank0(truncate_ours)
    fresh = build()
    out["cut_ours_load"] = refused(lambda: load_sharded_checkpoint([fresh], cut_ours), fresh, cut_ours)
    out["cut_ours_own"] = refused(lambda: load_with_own_calls(fresh, cut_ours), fresh, cut_ours)

    # --- a damaged quantization state file (its size unchanged, so the completion marker still matches)
    bad_state = os.path.join(root, "bad_state")

    def damage_state():
        shutil.copytree(ckpt, bad_state)
        state = Path(bad_state, "modelopt_moe_state.pt")
        size = state.stat().st_size
        state.write_bytes((b"\x80\x02" + bytes(range(256)) * (size // 256 + 1))[:size])

    on_rank0(damage_state)
    out["bad_state"] = refused(lambda: load_sharded_checkpoint([fresh], bad_state), fresh, bad_state)
    out["bad_state_own"] = refused(lambda: load_with_own_calls(fresh, bad_state), fresh, bad_state)

    # --- a data file whose bytes are damaged (sizes right): found only while reading; an Exception of ours
    garbled = os.path.join(root, "garbled")

    def garble():
        shutil.copytree(ckpt, garbled)
        victim = Path(garbled, "__0_0.distcp")
        victim.write_bytes(bytes(victim.stat().st_size))

    on_rank0(garble)
    out["garbled"] = _outcome(lambda: load_sharded_checkpoint([build()], garbled))
    dist.barrier()

    # --- a model not restored before it was wrapped / before its optimizer was built
    bare = build()
    with megatron_training_shims():
        ddp = DistributedDataParallel(config=bare.config, ddp_config=DistributedDataParallelConfig(), module=bare)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, params_dtype=torch.float32),
                                           [ddp])
        out["wrapped"] = refused(lambda: load_sharded_checkpoint([ddp], ckpt), bare, ckpt)
        out["with_optimizer"] = refused(lambda: load_sharded_checkpoint([bare], ckpt, optimizer=optimizer), bare,
                                        ckpt)
    # --- quantizing a model already wrapped (Float16Module inside Megatron's DDP, as Megatron-LM wraps it)
    unquantized = build()
    config = copy.copy(unquantized.config)
    config.bf16 = True
    with megatron_training_shims():
        wrapped = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(),
                                          module=Float16Module(config, unquantized))
        out["quantize_wrapped"] = refused(
            lambda: mtq.quantize(wrapped, mtq.load_config("fp8_default.yaml"), lambda m: m(tokens, positions, causal)),
            unquantized)
    # ... and the documented order works: restore, wrap, load
    fresh = build()
    restore_sharded_modelopt_state([fresh], ckpt)
    with megatron_training_shims():
        ddp = DistributedDataParallel(config=fresh.config, ddp_config=DistributedDataParallelConfig(), module=fresh)
        out["documented"] = _outcome(lambda: load_sharded_checkpoint([ddp], ckpt))

    # --- an optimizer of the other kind (distributed or not) than the one whose state the checkpoint holds
    def restored_and_wrapped(distributed):
        model = build()
        restore_sharded_modelopt_state([model], ckpt)
        with megatron_training_shims():
            ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
                use_distributed_optimizer=distributed))
            opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, params_dtype=torch.float32,
                                                         use_distributed_optimizer=distributed), [ddp])
        return model, ddp, opt

    saved_with = {True: os.path.join(root, "distributed_optimizer"), False: os.path.join(root, "local_optimizer")}
    for distributed, target in saved_with.items():
        _, ddp, opt = restored_and_wrapped(distributed)
        with megatron_training_shims():  # an optimizer that has not stepped yet
            out[f"save_{distributed}"] = _outcome(partial(save_sharded_checkpoint, [ddp], target, optimizer=opt))
    for distributed, target in saved_with.items():
        model, ddp, opt = restored_and_wrapped(not distributed)
        with megatron_training_shims():
            out[f"other_kind_{distributed}"] = refused(
                partial(load_sharded_checkpoint, [ddp], target, optimizer=opt), model, target)
        dist.barrier()
    model, ddp, opt = restored_and_wrapped(True)  # the distributed optimizer's state of its first step loads
    with megatron_training_shims():
        out["same_kind"] = _outcome(partial(load_sharded_checkpoint, [ddp], saved_with[True], optimizer=opt))
    want = {k: v for k, v in src.state_dict().items() if k.endswith("_amax")}
    got = {k: v for k, v in fresh.state_dict().items() if k.endswith("_amax")}
    out["documented_amax"] = bool(want) and want.keys() == got.keys() and all(torch.equal(got[k], v)
                                                                               for k, v in want.items())
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_safety")
    return spawn(_worker, WORLD, args=(str(root),), timeout=seconds(900))


def test_save_refuses_a_directory_that_is_not_our_checkpoint_and_writes_nothing(results):
    for r in results:
        message, unchanged = r["hf"]
        assert "FileExistsError" in message, message
        assert "hf_model" in message, message
        assert "config.json" in message, message
        assert "model-00001-of-00001.safetensors" in message, message
        assert unchanged
        assert not r["hf_tmp"]
        message, unchanged = r["plain"]
        assert "FileExistsError" in message, message
        assert "megatron_plain" in message, message
        assert ".metadata" in message, message
        assert unchanged
        message, unchanged = r["foreign_tmp"]
        assert "FileExistsError" in message, message
        assert "new.tmp" in message, message
        assert "notes.txt" in message, message
        assert unchanged
        assert r["replace_ours"] == "no error", r["replace_ours"]


def test_load_of_another_hidden_size_names_key_and_shapes_and_changes_nothing(results):
    for r in results:
        for case in ("wide_load", "wide_own"):
            message, unchanged = r[case]
            assert "CheckpointMismatchError" in message, (case, message)
            assert "embedding.word_embeddings.weight" in message, (case, message)
            assert "(256, 96)" in message, (case, message)
            assert "(256, 64)" in message, (case, message)
            assert unchanged, (case, message)


def test_truncated_data_file_without_our_marker_is_refused_before_loading(results):
    name, size = results[0]["cut_file"], results[0]["cut_size"]
    for r in results:
        for case in ("cut_own", "cut_load"):
            message, unchanged = r[case]
            assert "IncompleteCheckpointError" in message, (case, message)
            assert name in message, (case, message)
            assert f"truncated: {size} bytes" in message, (case, message)
            assert "needs" in message, (case, message)
            assert unchanged, case


def test_a_data_file_of_our_checkpoint_cut_short_is_called_truncated_and_a_removed_one_missing(results):
    cut = results[0]["cut_ours"]
    for r in results:
        for case in ("cut_ours_load", "cut_ours_own"):
            message, unchanged = r[case]
            assert "IncompleteCheckpointError" in message, (case, message)
            assert f"{cut['short']} is truncated: {cut['size']} bytes, the save wrote {cut['needed']}" in message, \
                (case, message)
            assert f"missing {cut['gone']}" in message, (case, message)
            assert f"missing {cut['short']}" not in message, (case, message)
            assert unchanged, case


def test_an_optimizer_of_the_other_kind_than_the_checkpoints_is_refused_naming_both(results):
    for r in results:
        for distributed in (True, False):
            assert r[f"save_{distributed}"] == "no error", r[f"save_{distributed}"]
            message, unchanged = r[f"other_kind_{distributed}"]
            assert "CheckpointMismatchError" in message, message
            assert f"holds the state of {'' if distributed else 'a non-'}" in message, message
            assert ("FP32Optimizer" if distributed else "DistributedOptimizer") in message, message
            assert f"use_distributed_optimizer={distributed} in both" in message, message
            assert "KeyError" not in message, message
            assert unchanged, message
        assert r["same_kind"] == "no error", r["same_kind"]


def test_damaged_state_file_is_named_and_never_advises_unsafe_loading(results):
    for r in results:
        for case in ("bad_state", "bad_state_own"):
            message, unchanged = r[case]
            assert "CorruptCheckpointError" in message, (case, message)
            assert "modelopt_moe_state.pt" in message, (case, message)
            assert "corrupt" in message, (case, message)
            assert "weights_only" not in message, (case, message)
            assert unchanged, case


def test_damaged_data_bytes_raise_an_exception_of_ours(results):
    for r in results:
        message = r["garbled"]
        assert "CorruptCheckpointError" in message, message
        assert "garbled" in message, message
        assert not message.startswith("BaseException")


def test_load_into_a_wrapped_unrestored_model_names_the_fix(results):
    for r in results:
        for case in ("wrapped", "with_optimizer"):
            message, unchanged = r[case]
            assert "CheckpointMismatchError" in message, (case, message)
            assert "restore_sharded_modelopt_state" in message, (case, message)
            assert unchanged, case
        assert r["documented"] == "no error", r["documented"]
        assert r["documented_amax"]


def test_quantize_of_a_wrapped_model_names_the_wrappers_and_changes_nothing(results):
    for r in results:
        message, unchanged = r["quantize_wrapped"]
        assert "ValueError: mtq.quantize: the model is already wrapped in DistributedDataParallel around " \
               "Float16Module; quantize it before wrapping" in message, message
        assert unchanged
