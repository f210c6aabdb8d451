r"""Make ``tests/fixtures/modelopt_0_47/histogram_cases.pt``: the activation amaxes NVIDIA Model Optimizer 0.47's
``HistogramCalibrator`` computes on CPU (``compute_amax("percentile" | "mse", ...)``; run once, the output is
committed).

In an environment with Model Optimizer 0.47 installed beside this package::

    python tools/make_modelopt_histogram_fixture.py [--out FILE]

The model and data are ``tools/make_modelopt_mse_fixture.py``'s (``nn.Sequential`` of ``nn.Linear(64, 48)``, ReLU,
``nn.Linear(48, 16)``, seed 0; ``randn(32, 64)``, seed 1): the calibrator collects the input of each linear in one
batch (over several batches Model Optimizer grows its range from the first batch's, docs/calibration.md). Per case:
the algorithm dict of this package, the quantizer's ``num_bits``, and the amax of each linear's input.

Model Optimizer 0.47's ``mse`` does not run as meant: ``_compute_amax_mse`` calls ``scaled_e4m3(centers, amax, 4,
3)`` and ``fake_tensor_quant(centers, amax, num_bits, unsigned)``, but both take ``bias`` third, so FP8 raises a
TypeError and INT quantizes with bias ``num_bits`` to 0 bits (its choice is meaningless). For the ``mse`` cases this
script calls them with the arguments in their places (``scaled_e4m3(x, amax, None, 4, 3)``,
``fake_tensor_quant(x, amax, None, num_bits, unsigned, narrow_range=False)``, the quantizer config's default) and
marks the case ``"patched": True``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from make_modelopt_mse_fixture import model_and_data

CASES = {  # name: (num_bits, this package's algorithm dict)
    "fp8_percentile_default": ((4, 3), {"histogram_method": "percentile"}),
    "fp8_percentile_99": ((4, 3), {"histogram_method": "percentile", "percentile": 99.0}),
    "int8_percentile_99_9_256_bins": (8, {"histogram_method": "percentile", "percentile": 99.9, "num_bins": 256}),
    "fp8_mse_default": ((4, 3), {"histogram_method": "mse"}),
    "int8_mse_default": (8, {"histogram_method": "mse"}),
    "fp8_mse_256_bins_stride_3": ((4, 3), {"histogram_method": "mse", "num_bins": 256, "start_bin": 16,
                                           "stride": 3}),
}


def main() -> None:
    """Runs Model Optimizer's histogram calibrator on each linear's input for every case and saves the amaxes."""
    import modelopt
    from modelopt.torch.quantization.calib import HistogramCalibrator
    from modelopt.torch.quantization.calib import histogram as modelopt_histogram
    from modelopt.torch.quantization.tensor_quant import fake_tensor_quant, scaled_e4m3

    def e4m3_in_place(x, amax, e, m):
        return scaled_e4m3(x, amax, None, e, m)

    def int_in_place(x, amax, num_bits, unsigned):
        return fake_tensor_quant(x, amax, None, num_bits, unsigned, False)

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/fixtures/modelopt_0_47/histogram_cases.pt")
    args = parser.parse_args()
    model, data = model_and_data()
    with torch.no_grad():
        inputs = {"0": data, "2": model[1](model[0](data))}
    cases = {}
    for name, (num_bits, algorithm) in CASES.items():
        amaxes = {}
        patched = algorithm["histogram_method"] == "mse"
        modelopt_histogram.scaled_e4m3 = e4m3_in_place if patched else scaled_e4m3
        modelopt_histogram.fake_tensor_quant = int_in_place if patched else fake_tensor_quant
        for layer, x in inputs.items():
            calib = HistogramCalibrator(num_bits=num_bits, num_bins=algorithm.get("num_bins", 2048))
            calib.collect(x)
            percentile = algorithm["histogram_method"] == "percentile"
            kwargs = ({"percentile": algorithm.get("percentile", 99.99)} if percentile
                      else {"start_bin": algorithm.get("start_bin", 128), "stride": algorithm.get("stride", 1)})
            amaxes[f"{layer}.input_quantizer"] = calib.compute_amax(algorithm["histogram_method"], **kwargs).float()
        cases[name] = {"num_bits": num_bits, "algorithm": {"method": "histogram", **algorithm}, "amax": amaxes,
                       "patched": patched}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"modelopt_version": modelopt.__version__, "cases": cases}, out)
    print(f"wrote {out}: {len(cases)} cases")


if __name__ == "__main__":
    main()
