"""Reading compressed-tensors NVFP4 MoE checkpoints with Hugging Face ``transformers``: a fix for its expert loader.

The bug: transformers 5.13 (the first release that loads compressed-tensors MoE experts into its fused
``gate_up_proj`` / ``down_proj`` tensors) through 5.23 (the newest release checked; no release fixes it yet)
dequantizes NVFP4 experts without their ``weight_global_scale``. 5.13 to 5.22 never collect that tensor for the
experts; 5.23 collects it and its expert dequantize (``CompressedTensorsDequantize.convert``) drops it. Every NVFP4
expert then comes out multiplied by its global scale (``448 * 6 / amax``, thousands), with no error or warning, and
the logits are wrong; attention and other dense layers, and FP8 experts, load right. Any NVFP4 compressed-tensors
MoE checkpoint is affected, whoever wrote it.

The fix: :func:`fix_nvfp4_experts` makes transformers decode each NVFP4 expert with compressed-tensors' own NVFP4
decoder (``NVFP4PackedCompressor.decompress``, the one transformers uses for the dense layers of the same file), the
global scale included. It works with ``CompressedTensorsConfig(dequantize=True)`` and with the default load::

    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from modelopt_moe.export import transformers_compat

    transformers_compat.fix_nvfp4_experts()  # once per process, before loading
    model = AutoModelForCausalLM.from_pretrained("out/", quantization_config=CompressedTensorsConfig(dequantize=True))

or for one block only: ``with transformers_compat.fix_nvfp4_experts(): ...``. It is a no-op (with a note saying
why) when transformers is not installed, predates the bug, or is a release that fixes it (:data:`FIXED_IN`); it
raises for 5.13 to 5.22, whose loader never hands the global scale over (upgrade to 5.23).

This module imports torch alone; transformers and compressed-tensors are imported when the fix is applied.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch

from .errors import ExportError

__all__ = ["AFFECTED_SINCE", "FIXED_IN", "PATCHABLE_SINCE", "AFFECTED_VERSIONS", "AFFECTED_FORMAT",
           "nvfp4_experts_affected", "fix_nvfp4_experts", "NVFP4ExpertsFix"]

AFFECTED_SINCE = (5, 13)  # the first release with the fused-expert compressed-tensors loader
PATCHABLE_SINCE = (5, 23)  # the first release that hands weight_global_scale to the experts' dequantize
FIXED_IN: tuple[int, int] | None = None  # the first release that fixes it; set when one does
AFFECTED_VERSIONS = "transformers 5.13 and later (5.23 the newest checked; no release fixes it yet)"

_log = logging.getLogger(__name__)
# The compressed-tensors weight format whose MoE experts transformers mis-scales.
AFFECTED_FORMAT = "nvfp4-pack-quantized"


def _parse(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        raise ExportError(f"transformers version {version!r}: expected 'MAJOR.MINOR...'")
    return int(m.group(1)), int(m.group(2))


def _installed_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def nvfp4_experts_affected(version: str | None = None) -> bool:
    """Whether a transformers release mis-scales compressed-tensors NVFP4 MoE experts (see the module docstring).

    Args:
        version: a transformers version (``"5.23.0"``); None: the installed one (False when none is installed).
    """
    version = version if version is not None else _installed_version()
    if version is None:
        return False
    v = _parse(version)
    return v >= AFFECTED_SINCE and (FIXED_IN is None or v < FIXED_IN)


@dataclass
class NVFP4ExpertsFix:
    """What :func:`fix_nvfp4_experts` did: ``applied`` (transformers is patched until :meth:`remove`) and a
    ``note`` saying why. Usable as a context manager: leaving the block removes the patch."""

    applied: bool
    note: str
    _removed: bool = field(default=False, repr=False)

    def remove(self) -> None:
        """Undoes this call's patch (idempotent); transformers is unpatched once every applied fix is removed."""
        if self.applied and not self._removed:
            self._removed = True
            _release()

    def __enter__(self) -> NVFP4ExpertsFix:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


_state: dict = {"users": 0, "original": None}


def fix_nvfp4_experts() -> NVFP4ExpertsFix:
    """Makes transformers dequantize compressed-tensors NVFP4 MoE experts with their ``weight_global_scale``, when
    the installed release needs it; in this process, until the returned handle is removed (or its ``with`` block
    ends). Call it before ``from_pretrained``; calling it again is harmless.

    Returns:
        The handle: ``applied`` and a ``note`` (also logged at INFO).

    Raises:
        ExportError: transformers 5.13 to 5.22 (they never hand the experts' global scale to the dequantize:
            upgrade to 5.23), or a release whose loader is not the one this fix knows.
    """
    version = _installed_version()
    if version is None:
        return _noop("transformers is not installed: nothing to fix")
    v = _parse(version)
    if v < AFFECTED_SINCE:
        return _noop(f"transformers {version} predates the compressed-tensors expert loader that drops "
                     "weight_global_scale (5.13): this fix does not apply to it")
    if FIXED_IN is not None and v >= FIXED_IN:
        return _noop(f"transformers {version} loads NVFP4 experts with their global scale: nothing to fix")
    if v < PATCHABLE_SINCE:
        raise ExportError(f"transformers {version} dequantizes compressed-tensors NVFP4 MoE experts without their "
                          "weight_global_scale (wrong logits) and never passes it to the experts' loader, so this "
                          "fix cannot apply; install transformers>=5.23 (then call fix_nvfp4_experts()), or serve "
                          "the checkpoint with vLLM")
    _acquire(version)
    note = (f"transformers {version}: compressed-tensors NVFP4 MoE experts are decoded with compressed-tensors' "
            "NVFP4PackedCompressor.decompress, weight_global_scale included")
    _log.info(note)
    return NVFP4ExpertsFix(True, note)


def _noop(note: str) -> NVFP4ExpertsFix:
    _log.info(note)
    return NVFP4ExpertsFix(False, note)


def _acquire(version: str) -> None:
    from transformers.integrations import compressed_tensors as ct_integration
    from transformers.quantizers.quantizer_compressed_tensors import CompressedTensorsHfQuantizer

    target = getattr(ct_integration, "CompressedTensorsDequantize", None)
    names = getattr(CompressedTensorsHfQuantizer, "serialized_names", None)
    if target is None or not isinstance(names, dict) or "weight_global_scale" not in names.get("weight", ()):
        raise ExportError(f"transformers {version}: its compressed-tensors loader is not the one this fix knows "
                          "(5.23: CompressedTensorsDequantize, weight_global_scale among the serialized names); "
                          "use transformers 5.23, or serve the checkpoint with vLLM")
    if _state["users"] == 0:
        _state["original"] = target.convert
        target.convert = _patched_convert(_state["original"], ct_integration)
    _state["users"] += 1


def _release() -> None:
    from transformers.integrations import compressed_tensors as ct_integration

    _state["users"] -= 1
    if _state["users"] == 0:
        ct_integration.CompressedTensorsDequantize.convert = _state["original"]
        _state["original"] = None


def _patched_convert(original, ct_integration):
    """``CompressedTensorsDequantize.convert`` with NVFP4 experts decoded whole; everything else unchanged."""

    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, **kwargs):
        def unchanged():
            return original(self, input_dict, source_patterns, target_patterns, full_layer_name=full_layer_name,
                            **kwargs)

        if "weight" in input_dict or "weight_scale" in input_dict:  # one dense module: transformers passes it all
            return unchanged()
        config = self.hf_quantizer.compressor.quantization_config
        scheme = self.scheme or ct_integration.get_experts_scheme(config)
        fmt = scheme.format or config.format
        if getattr(fmt, "value", fmt) != AFFECTED_FORMAT:
            return unchanged()
        return _decode_nvfp4_experts(input_dict, scheme, kwargs["model"].get_parameter(full_layer_name).dtype)

    convert.__wrapped__ = original
    return convert


def _decode_nvfp4_experts(input_dict: dict, scheme, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``{"...weight_packed": [per-expert tensors], ...}`` -> ``{"...weight_packed": [E, out, in] decoded}``."""
    from compressed_tensors.compressors import NVFP4PackedCompressor

    def listed(value):
        return value if isinstance(value, list | tuple) else [value]

    out = {}
    for key in [k for k in input_dict if k.endswith("weight_packed")]:
        stem = key[: -len("weight_packed")]
        parts = {}
        for name in ("weight_packed", "weight_scale", "weight_global_scale"):
            if stem + name not in input_dict:
                raise ExportError(f"NVFP4 experts {key}: no {stem + name} reached the experts' dequantize; this "
                                  "transformers release is not the one the fix knows")
            parts[name] = listed(input_dict[stem + name])
        counts = {len(v) for v in parts.values()}
        if len(counts) != 1:
            raise ExportError(f"NVFP4 experts {key}: {[len(v) for v in parts.values()]} packed weights, block "
                              "scales and global scales (expected one of each per expert)")
        decoded = None
        for i, (packed, scale, global_scale) in enumerate(zip(*parts.values(), strict=True)):
            w = NVFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale,
                                                  "weight_global_scale": global_scale}, scheme)["weight"]
            if decoded is None:  # one buffer for all experts, as transformers' own loop allocates it
                decoded = torch.empty((len(parts["weight_packed"]), *w.shape), dtype=dtype, device=w.device)
            decoded[i].copy_(w)
        out[key] = decoded
    return out
