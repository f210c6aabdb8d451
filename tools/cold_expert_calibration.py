"""Per-expert input amax of a short calibration against a long one, with and without ``moe_calib_experts_ratio``
(CPU, one process; docs/calibration.md).

The model: the tests' small Megatron MoE GPT (``tests/megatron_harness``: 2 layers, 16 SequentialMLP experts, top-2,
Megatron's initialization, not trained), FP8 with per-expert input amaxes. The reference: max calibration on 64
sequences of 32 tokens of English text with the model's own routing. Each variant calibrates on 1 sequence of 32
tokens; per expert input quantizer (fc1, fc2 of both layers: 64 expert amaxes) it prints the experts that saw no
token and the relative error ``|amax - amax_ref| / amax_ref`` (median and max), as a Markdown table.

Usage: ``python tools/cold_expert_calibration.py`` (from the repository root, about a minute).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

VARIANTS = {"short, model's routing": None, "short, ratio 0.25 (4 of 16)": 0.25, "short, ratio 1.0": 1.0,
            "long, ratio 1.0": 1.0}


def _input_amaxes(model) -> tuple[torch.Tensor, torch.Tensor]:
    amax, rows = [], []
    for layer in model.decoder.layers:
        for gemm in ("linear_fc1", "linear_fc2"):
            q = getattr(layer.mlp.experts, gemm).input_quantizer
            amax.append(q.amax.clone())
            rows.append(q.calibrated_rows.clone())
    return torch.cat(amax), torch.cat(rows)


def _run(rank, world_size):
    import megatron_harness.models as mm

    import modelopt_moe.quantization as mtq

    mm.init_model_parallel(1, 1, seed=1)
    long_data, short_data = mm.text_batches(8, 32, 8), mm.text_batches(1, 32, 1, offset=100)

    def calibrate(ratio, data):
        model = mm.build_moe_gpt(num_experts=16, seed=3).eval()
        cfg = mtq.load_config("fp8_default.yaml")
        cfg.experts.input_amax = "per_expert"
        algorithm = {"method": "max"} if ratio is None else {"method": "max", "moe_calib_experts_ratio": ratio}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mtq.quantize(model, {**cfg.model_dump(), "algorithm": algorithm},
                         lambda m: [mm.lm_loss(m, b) for b in data])
        return _input_amaxes(model)

    ref, ref_rows = calibrate(None, long_data)
    out = {"reference unseen": int((ref_rows == 0).sum())}
    for name, ratio in VARIANTS.items():
        amax, rows = calibrate(ratio, long_data if name.startswith("long") else short_data)
        err = ((amax - ref).abs() / ref).flatten()
        out[name] = (int((rows == 0).sum()), float(err.median()), float(err.max()))
    mm.destroy_model_parallel()
    return out


def main() -> None:
    """Prints the table."""
    from modelopt_moe.launch import spawn

    (out,) = spawn(_run, 1, timeout=900)
    print(f"reference (64 x 32 tokens, the model's routing): {out['reference unseen']} of 64 expert inputs unseen\n")
    print("| calibration | expert inputs without a token | median relative amax error | max relative amax error |")
    print("|---|---:|---:|---:|")
    for name in VARIANTS:
        unseen, median, worst = out[name]
        print(f"| {name} | {unseen} of 64 | {median:.3f} | {worst:.3f} |")


if __name__ == "__main__":
    main()
