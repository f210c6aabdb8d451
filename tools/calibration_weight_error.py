"""Weight quantization error of max calibration against the weight MSE search, on CPU (docs/calibration.md).

Quantizes one grouped expert linear (8 experts of [256 x 512], ``GroupedLinear``) whose weights are drawn
bell-shaped (normal, std 0.02, as Megatron initializes) or heavy-tailed (Student-t with 4 degrees of freedom, std
0.02: a few large weights, as trained weights have), each expert scaled by its own factor, in each weight format and
scaling, with ``algorithm: max``, ``mse`` (Model Optimizer 0.47's default grid: 0.25 to 4 in 39 steps) and ``mse``
on a grid that holds 1 (step 0.125); prints the relative squared error ``sum (w - Q(w))**2 / sum w**2`` over all
experts, as a Markdown table. A second table compares NVFP4's block scales: from the weights (max calibration),
static ones chosen by the FP8 scale sweep (``mse`` with ``fp8_scale_sweep``), and the 4-over-6 rule
(``four_over_six`` with the multiplier grid {1, 1.5}, Model Optimizer's ``nvfp4_four_over_six`` preset).

Usage: ``python tools/calibration_weight_error.py [--seed 0]``
"""

from __future__ import annotations

import argparse
import copy
import warnings

import torch

import modelopt_moe.quantization as mtq
from modelopt_moe.quantization.nn import GroupedLinear

WEIGHTS = {"bell (normal)": lambda g, shape: torch.randn(shape, generator=g),
           "heavy-tailed (t, 4 dof)": lambda g, shape: _student_t(g, shape, 4.0)}
FORMATS = {"FP8 E4M3 per expert": {"num_bits": (4, 3), "axis": None},
           "FP8 E4M3 per channel": {"num_bits": (4, 3), "axis": 0},
           "INT8 per channel": {"num_bits": 8, "axis": 0},
           "INT4 per channel": {"num_bits": 4, "axis": 0},
           "NVFP4": {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}}
ALGORITHMS = {"max": "max", "mse (default grid)": {"method": "mse"},
              "mse (grid with 1)": {"method": "mse", "step_size": 0.125}}
_STATIC = {-1: 16, "type": "static", "scale_bits": (4, 3)}
NVFP4_BLOCK_SCALES = {  # column: (weight quantizer, algorithm)
    "max (block max)": (FORMATS["NVFP4"], "max"),
    "fp8_scale_sweep": ({"num_bits": (2, 1), "block_sizes": _STATIC}, {"method": "mse", "fp8_scale_sweep": True}),
    "4-over-6": ({"num_bits": (2, 1), "block_sizes": {**_STATIC, "four_over_six": True}},
                 {"method": "mse", "start_multiplier": 1.0, "stop_multiplier": 1.5, "step_size": 0.5}),
}


def _student_t(g: torch.Generator, shape, dof: float) -> torch.Tensor:
    z = torch.randn(shape, generator=g)
    chi2 = torch.randn((dof.__int__(), *shape), generator=g).square().sum(0)
    t = z / (chi2 / dof).sqrt()
    return t / t.std()


def relative_error(experts: GroupedLinear) -> float:
    """``sum (w - Q(w))**2 / sum w**2`` over every expert weight."""
    q = experts.weight_quantizer
    num = den = 0.0
    with torch.no_grad():
        for i, w in enumerate(experts.expert_weights()):
            num += float((w - q.fake_quant_expert(i, w)).square().sum())
            den += float(w.square().sum())
    return num / den


def _experts(draw, seed: int) -> GroupedLinear:
    g = torch.Generator().manual_seed(seed)
    base = GroupedLinear(num_gemms=8, in_features=512, out_features=256)
    with torch.no_grad():
        for i, w in enumerate(base.expert_weights()):
            w.copy_(draw(g, w.shape) * 0.02 * (1 + i / 4))
    return base


def _error(base: GroupedLinear, wcfg: dict, algorithm) -> str:
    experts = copy.deepcopy(base)
    config = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                            {"quantizer_name": "*weight_quantizer", "cfg": wcfg}],
              "algorithm": algorithm, "weight_amax_update": "static"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(experts, config, None)
    return f"{relative_error(experts):.3e}"


def main() -> None:
    """Prints the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("| weights | format | " + " | ".join(ALGORITHMS) + " |")
    print("|---|---|" + "---:|" * len(ALGORITHMS))
    for wname, draw in WEIGHTS.items():
        base = _experts(draw, args.seed)
        for fname, wcfg in FORMATS.items():
            cells = [_error(base, wcfg, algorithm) for algorithm in ALGORITHMS.values()]
            print(f"| {wname} | {fname} | " + " | ".join(cells) + " |")
    print()
    print("| weights | NVFP4 " + " | NVFP4 ".join(NVFP4_BLOCK_SCALES) + " |")
    print("|---|" + "---:|" * len(NVFP4_BLOCK_SCALES))
    for wname, draw in WEIGHTS.items():
        base = _experts(draw, args.seed)
        cells = [_error(base, wcfg, algorithm) for wcfg, algorithm in NVFP4_BLOCK_SCALES.values()]
        print(f"| {wname} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
