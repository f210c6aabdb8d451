"""Activation quantization error of max calibration against histogram calibration (percentile, mse), on CPU
(docs/calibration.md).

Calibrates the input quantizer of one grouped expert linear (8 experts, 512 inputs, ``input_amax: per_expert``) on
8 batches of 64 tokens per expert, drawn bell-shaped (normal) or heavy-tailed (Student-t with 3 degrees of freedom:
a few large activations), expert ``i`` scaled by ``1 + i/4``; then measures the relative squared error
``sum (x - Q(x))**2 / sum x**2`` of held-out tokens of the same distribution (8 other batches), over all experts, for
``algorithm: max``, ``histogram`` with ``percentile`` 99.99 and 99.9, and ``histogram`` with ``mse`` (Model Optimizer's
defaults: 2048 bins, start bin 128), per format; a Markdown table.

Usage: ``python tools/calibration_activation_error.py [--seed 0]``
"""

from __future__ import annotations

import argparse
import warnings

import torch

import modelopt_moe.quantization as mtq
from modelopt_moe.quantization.nn import GroupedLinear

EXPERTS, TOKENS, FEATURES, BATCHES = 8, 64, 512, 8
ACTIVATIONS = {"bell (normal)": lambda g, shape: torch.randn(shape, generator=g),
               "heavy-tailed (t, 3 dof)": lambda g, shape: _student_t(g, shape, 3.0)}
FORMATS = {"FP8 E4M3": (4, 3), "INT8": 8}
ALGORITHMS = {"max": "max",
              "percentile 99.99": {"method": "histogram", "percentile": 99.99},
              "percentile 99.9": {"method": "histogram", "percentile": 99.9},
              "mse": {"method": "histogram", "histogram_method": "mse"}}


def _student_t(g: torch.Generator, shape, dof: float) -> torch.Tensor:
    normal = torch.randn(shape, generator=g)
    chi2 = torch.distributions.Chi2(torch.tensor(dof)).sample(shape)
    return normal / torch.sqrt(chi2 / dof)


def _batches(draw, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the Chi2 sampler's
    scale = torch.repeat_interleave(1 + torch.arange(EXPERTS) / 4, TOKENS).unsqueeze(1)
    return [draw(g, (EXPERTS * TOKENS, FEATURES)) * scale for _ in range(BATCHES)]


def relative_error(num_bits, algorithm, calib: list[torch.Tensor], held_out: list[torch.Tensor]) -> float:
    """``sum (x - Q(x))**2 / sum x**2`` of ``held_out`` with the input amaxes calibrated on ``calib``."""
    torch.manual_seed(0)
    layer = GroupedLinear(num_gemms=EXPERTS, in_features=FEATURES, out_features=16)
    config = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                            {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": num_bits, "axis": None}}],
              "algorithm": algorithm, "experts": {"input_amax": "per_expert"}}
    splits = [TOKENS] * EXPERTS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, config, lambda m: [m(x, splits) for x in calib])
    q = layer.input_quantizer
    error = total = 0.0
    with torch.no_grad():
        for x in held_out:
            for i, chunk in enumerate(torch.split(x, splits)):
                error += float(((chunk - q.fake_quant_expert(i, chunk)) ** 2).sum())
                total += float((chunk ** 2).sum())
    return error / total


def main() -> None:
    """Prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("| activations | format | " + " | ".join(ALGORITHMS) + " |")
    print("|---|---|" + "---:|" * len(ALGORITHMS))
    for name, draw in ACTIVATIONS.items():
        calib, held_out = _batches(draw, args.seed), _batches(draw, args.seed + 1)
        for fmt, num_bits in FORMATS.items():
            cells = [f"{relative_error(num_bits, a, calib, held_out):.3e}" for a in ALGORITHMS.values()]
            print(f"| {name} | {fmt} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
