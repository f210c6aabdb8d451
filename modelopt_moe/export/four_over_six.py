"""The serving setting that NVFP4 inputs quantized with 4-over-6 block scales need, said where engines and users look.

Weights quantized with 4-over-6 are plain NVFP4 tensors (:class:`~modelopt_moe.numerics.nvfp4.NVFP4FourOverSixFormat`):
any NVFP4 reader decodes them exactly. Inputs quantized with 4-over-6 store a 256-normalized global scale
(``input amax / 1536``), and the engine rounds them as training did only with FlashInfer's 4-over-6 activation recipe
(:data:`ENGINE_SETTINGS`); an engine without it runs plain NVFP4 activations under that scale, which is valid but not
what was trained. So where weights or inputs use 4-over-6 the export writes:

* a machine-readable marker, the top-level key :data:`MARKER_KEY` of ``config.json``'s ``quantization_config`` (and
  of ``hf_quant_config.json``, beside its ``producer``): the linears whose inputs (``input_activations``) and weights
  (``weights``) use 4-over-6, as compressed-tensors ``targets`` (exact names and ``re:`` patterns of whole experts
  modules), the block-scale normalization and the engine settings (none where only weights use it). The readers keep
  or ignore it without complaint (compressed-tensors' ``QuantizationConfig`` and transformers ignore unknown
  top-level keys; the config groups, which refuse unknown fields, are left as plain NVFP4). Readers of amaxes (the
  checker) convert the named linears' second-level scales with ``amax / 1536``, not NVFP4's ``amax / 2688``;

and where inputs use it:

* a section of the model card (:mod:`.model_card`);
* a warning once on rank 0 naming the layers and the engine setting.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..numerics.nvfp4 import FOUR_OVER_SIX_SCALE_MAX, NVFP4_FOUR_OVER_SIX
from .layer_schemes import ct_targets
from .schemes import Scheme

__all__ = ["MARKER_KEY", "ENGINE_SETTINGS", "four_over_six_inputs", "four_over_six_weights", "marker",
           "served_setting_warning", "card_lines"]

MARKER_KEY = "nvfp4_four_over_six"
# FlashInfer's 4-over-6 NVFP4 activation quantization (used by vLLM and SGLang): the rule training used (the smaller
# squared error per block of 16, block scales normalized to 256), its error in exact arithmetic rather than fast math.
ENGINE_SETTINGS = {"FLASHINFER_NVFP4_4OVER6": "1", "FLASHINFER_NVFP4_4OVER6_E4M3_USE_256": "1",
                   "FLASHINFER_NVFP4_4OVER6_ERR_MODE": "MSE", "FLASHINFER_NVFP4_4OVER6_ERR_USE_FAST_MATH": "0"}


def four_over_six_inputs(scheme: Scheme | None) -> bool:
    """Whether ``scheme`` quantizes its inputs with 4-over-6 block scales."""
    return scheme is not None and scheme.input_quantized and scheme.input_fmt == NVFP4_FOUR_OVER_SIX.name


def four_over_six_weights(scheme: Scheme | None) -> bool:
    """Whether ``scheme``'s weights are quantized with 4-over-6 block scales."""
    return scheme is not None and scheme.weight_fmt == NVFP4_FOUR_OVER_SIX.name


def _targets(schemes: Mapping[str, Scheme | None], chosen) -> list[str]:
    modules = [m for m, s in schemes.items() if chosen(s)]
    return ct_targets(modules, "4o6", {m: "4o6" if chosen(s) else None for m, s in schemes.items()})


def marker(schemes: Mapping[str, Scheme | None]) -> dict | None:
    """The :data:`MARKER_KEY` entry of a checkpoint whose linears have ``schemes`` (Hugging Face name -> scheme, None:
    unquantized); None where no linear uses 4-over-6. Its engine settings are empty where only weights use it (they
    need nothing of the engine)."""
    inputs = _targets(schemes, four_over_six_inputs)
    weights = _targets(schemes, four_over_six_weights)
    if not inputs and not weights:
        return None
    return {"input_activations": inputs, "weights": weights,
            "block_scale_max": FOUR_OVER_SIX_SCALE_MAX, "choice": "smaller squared error of max->6 and max->4, "
            "ties to 6", "engine_settings": dict(ENGINE_SETTINGS) if inputs else {}}


def _settings() -> str:
    return " ".join(f"{k}={v}" for k, v in ENGINE_SETTINGS.items())


def served_setting_warning(schemes: Mapping[str, Scheme | None], fmt: str) -> str | None:
    """The warning of an export in ``fmt`` where inputs use 4-over-6 (None: none do), naming the layers and the engine
    setting."""
    layers = [m for m, s in schemes.items() if four_over_six_inputs(s)]
    if not layers:
        return None
    return (f"export_hf(format={fmt!r}): {len(layers)} linears (e.g. {layers[0]}) trained their NVFP4 inputs with "
            f"4-over-6 block scales (input scale = amax / {int(NVFP4_FOUR_OVER_SIX.bound)}): serve them with "
            f"FlashInfer's nvfp4_4over6 activation quantization ({_settings()}); an engine without it runs plain NVFP4 "
            f"activations under that scale (valid, not what was trained). quantization_config.{MARKER_KEY} lists them")


def card_lines(schemes: Mapping[str, Scheme | None]) -> list[str]:
    """The model card's section on the serving setting (empty where no linear's inputs use 4-over-6)."""
    inputs = _targets(schemes, four_over_six_inputs)
    if not inputs:
        return []
    targets = ", ".join(f"`{t}`" for t in inputs)
    return ["## Serving setting: 4-over-6 activations", "",
            f"The inputs of {targets} were quantized in training with NVFP4 4-over-6 block scales (per block of 16, "
            "the scale mapping its max to E2M1's 6 or to its 4, whichever gives the smaller squared error; the "
            f"input scale normalized to 256: `input amax / {int(NVFP4_FOUR_OVER_SIX.bound)}`). Serve them with "
            f"FlashInfer's `nvfp4_4over6` activation quantization: `{_settings()}` (vLLM, SGLang). An engine "
            "without it runs plain NVFP4 activations under these scales: valid, not what was trained. "
            f"`quantization_config.{MARKER_KEY}` says the same for programs.", ""]
