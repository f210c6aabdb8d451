"""``smooth_expert_inputs`` through the public API on a bf16 Megatron MoE GPT with SwiGLU experts (SequentialMLP and
grouped): ``mtq.quantize(model, mtq.load_config("smooth.yaml"), forward_loop)`` rescales the experts' fc2 input
channels by powers of two and leaves the model's outputs bit-identical; experts it cannot rescale exactly (non-gated,
clamped or offset GLUs) are refused by module path with nothing changed; a calibration that fails after the rescale
puts the weights back bit for bit; and a checkpoint of the rescaled model restores its weights as saved (the rescale
is never applied twice: a restore converts without calibrating, a second quantize is refused, and quantizing the
rescaled weights afresh finds every scale at 1). One process."""

import torch
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn

YAML = "$import: nvfp4_experts.yaml\nsmooth_expert_inputs: {alpha: 0.5}\n"


def _worker(rank, world_size, tmp):
    import megatron_harness.models as mm
    import torch.nn.functional as F

    import modelopt_moe.quantization as mtq
    from modelopt_moe.checkpoint import restore_sharded_modelopt_state
    from modelopt_moe.plugins.megatron import load_sharded_checkpoint, save_sharded_checkpoint

    mm.init_model_parallel(1, 1, seed=7)
    batches = mm.text_batches(2, 32, 2)
    config = mtq.load_config(f"{tmp}/smooth.yaml")
    swiglu = {"gated_linear_unit": True, "activation_func": F.silu}

    def logits(model):
        with torch.no_grad():
            return torch.cat([model(b["tokens"], b["position_ids"], b["attention_mask"]) for b in batches])

    def build(experts, **overrides):
        return mm.build_moe_gpt(ffn_hidden=64, num_experts=4, params_dtype=torch.bfloat16, experts=experts,
                                **{**swiglu, **overrides}).eval()

    def params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    out = {}
    for experts in ("sequential", "grouped"):
        model = build(experts)
        before, ref = params(model), logits(model)
        mtq.quantize(model, config, logits)
        after = params(model)
        quantized = logits(model)
        enabled = [q for _, q, _ in mtq.named_quantizers(model) if q.is_enabled]
        mtq.disable_quantizer(model, "*")
        out[experts] = {"before": before, "after": after, "diff": (logits(model) - ref).abs().max().item()}
        for q in enabled:
            q.enable()
        if experts == "sequential":  # saved, then restored into a fresh model (the same starting weights)
            save_sharded_checkpoint([model], f"{tmp}/ckpt")
            fresh = build(experts)
            restore_sharded_modelopt_state([fresh], f"{tmp}/ckpt")
            load_sharded_checkpoint([fresh], f"{tmp}/ckpt")
            restored = params(fresh)
            try:
                mtq.quantize(fresh, config, logits)
                again = None
            except ValueError as e:
                again = str(e)
            # the rescaled weights in a fresh, unquantized model, quantized again: the rule finds s = 1 everywhere
            again_model = build(experts)
            with torch.no_grad():
                for n, p in again_model.named_parameters():
                    p.copy_(after[n])
            mtq.quantize(again_model, config, logits)
            out["idempotent"] = all(torch.equal(p, after[n]) for n, p in again_model.named_parameters())
            out["restore"] = {"equal": all(torch.equal(restored[n], after[n]) for n in after),
                              "logits": torch.equal(logits(fresh), quantized), "again": again,
                              "unchanged": all(torch.equal(p, restored[n]) for n, p in fresh.named_parameters())}
    # a calibration that fails after the rescale: the weights are back bit for bit, nothing is quantized
    model = build("grouped")
    before, calls = params(model), []

    def failing(m):
        calls.append(1)
        if len(calls) == 2:  # the calibration pass, after the rescale's pass
            raise RuntimeError("calibration data ran out")
        logits(m)

    try:
        mtq.quantize(model, config, failing)
    except RuntimeError as e:
        out["failed"] = {"message": str(e), "calls": len(calls),
                         "unchanged": all(torch.equal(p, before[n]) for n, p in model.named_parameters()),
                         "quantized": any(type(m).__name__.startswith("Quant") for m in model.modules())}
    errors = {}
    for name, experts, overrides in (
            ("gelu", "sequential", {"gated_linear_unit": False, "activation_func": F.gelu}),
            ("clamped", "grouped", {"activation_func_clamp_value": 7.0}),
            ("offset", "sequential", {"glu_linear_offset": 1.0})):
        model = build(experts, **overrides)
        before = params(model)
        try:
            mtq.quantize(model, config, logits)
        except ValueError as e:
            errors[name] = (str(e), all(torch.equal(p, before[n]) for n, p in model.named_parameters()),
                            any(type(m).__name__.startswith("Quant") for m in model.modules()))
    out["errors"] = errors
    mm.destroy_model_parallel()
    return out


def _refusal_worker(rank, world_size):
    import megatron_harness.models as mm
    import torch.nn.functional as F

    import modelopt_moe.quantization as mtq
    from modelopt_moe.quantization.nn import GroupedLinear

    mm.init_model_parallel(1, 1, seed=7)
    if rank == 0:  # as a pipeline stage that holds no expert layer
        model = GroupedLinear(num_gemms=2, in_features=64, out_features=64)

        def loop(m):
            m(torch.randn(4, 64), [2, 2])
    else:  # GELU experts: refused
        model = mm.build_moe_gpt(ffn_hidden=64, num_experts=4, params_dtype=torch.bfloat16,
                                 gated_linear_unit=False, activation_func=F.gelu).eval()
        batches = mm.text_batches(2, 32, 1)

        def loop(m):
            for b in batches:
                m(b["tokens"], b["position_ids"], b["attention_mask"])

    try:
        mtq.quantize(model, {**mtq.FP8_DEFAULT_CFG, "smooth_expert_inputs": {"alpha": 0.5}}, loop)
        message = None
    except ValueError as e:
        message = str(e)
    quantized = any(type(m).__name__.startswith("Quant") or hasattr(m, "weight_quantizer") for m in model.modules())
    mm.destroy_model_parallel()
    return message, quantized


def test_a_refusal_on_some_ranks_is_raised_on_every_rank():
    """A rank without the refused expert layers (a pipeline stage without experts) raises too, instead of going on
    into calibration and waiting for the ranks that raised (2 gloo ranks)."""
    (elsewhere, quantized0), (here, quantized1) = spawn(_refusal_worker, 2, timeout=seconds(120))
    assert "decoder.layers.0.mlp.experts: gated_linear_unit=False" in here, here
    assert "cannot rescale expert layers of other ranks exactly" in elsewhere, elsewhere
    assert "Nothing was changed" in elsewhere, elsewhere
    assert not quantized0
    assert not quantized1


def _is_power_of_two(t: torch.Tensor) -> bool:
    return bool((torch.exp2(torch.round(torch.log2(t))) == t).all())


def test_the_rescale_keeps_outputs_bit_exact_refuses_what_it_cannot_and_is_never_applied_twice(tmp_path):
    (tmp_path / "smooth.yaml").write_text(YAML)
    out = spawn(_worker, 1, args=(str(tmp_path),), timeout=seconds(300))[0]
    for experts in ("sequential", "grouped"):
        r = out[experts]
        assert r["diff"] == 0.0, (experts, r["diff"])  # bf16, atol=0
        moved = sorted(n for n in r["after"] if not torch.equal(r["after"][n], r["before"][n]))
        assert moved, experts
        assert all("experts" in n and ("linear_fc1" in n or "linear_fc2" in n) for n in moved), moved
        for name in [n for n in moved if "linear_fc2" in n]:
            fc2, fc2_before = r["after"][name].double(), r["before"][name].double()
            s = (fc2 / fc2_before)[0]  # column j times s_j
            assert _is_power_of_two(s), (name, s)
            assert (s != 1).any(), (name, s)
            assert torch.equal(fc2, fc2_before * s[None, :]), name
            fc1 = name.replace("linear_fc2", "linear_fc1")
            f = fc2.shape[1]
            up, up_before = r["after"][fc1].double()[f:], r["before"][fc1].double()[f:]
            assert torch.equal(up * s[:, None], up_before), fc1  # the up rows divided by the same s_j
            assert torch.equal(r["after"][fc1][:f], r["before"][fc1][:f]), fc1  # the gate rows untouched
    assert out["idempotent"]  # rescaled weights quantized again with the same alpha and data: not rescaled again
    restore = out["restore"]
    assert restore["equal"], restore  # the saved (rescaled) weights, not rescaled again
    assert restore["logits"], restore
    assert "already quantized" in restore["again"], restore  # a second quantize is refused ...
    assert restore["unchanged"], restore  # ... and changes nothing
    failed = out["failed"]
    assert failed == {"message": "calibration data ran out", "calls": 2, "unchanged": True, "quantized": False}, failed
    errors = out["errors"]
    assert set(errors) == {"gelu", "clamped", "offset"}, errors
    message, unchanged, quantized = errors["gelu"]
    assert "smooth_expert_inputs cannot rescale these expert layers exactly" in message, message
    assert "decoder.layers.0.mlp.experts: gated_linear_unit=False (gelu of fc1's output)" in message, message
    assert "decoder.layers.1.mlp.experts: gated_linear_unit=False" in message, message
    assert "Supported: a plain gated linear unit" in message, message
    assert "decoder.layers.0.mlp.experts: activation_func_clamp_value=7.0" in errors["clamped"][0]
    assert "decoder.layers.0.mlp.experts: glu_linear_offset=1.0" in errors["offset"][0]
    assert all(unchanged and not quantized for _, unchanged, quantized in errors.values()), errors
