"""The model card (``README.md``) of every export: what the checkpoint holds and how to read it right.

Whoever receives a checkpoint sees its ``README.md`` first (the Hugging Face Hub renders it and reads its YAML front
matter: ``library_name``, ``tags``, ``base_model``). The card states the format, the quantization of every group of
modules (weights and inputs, block size, scale tensors; what stays unquantized and in which dtype), the readers known
to read it exactly, and, where a reader needs one, the fix: transformers mis-scales compressed-tensors NVFP4 MoE
experts silently (:mod:`.transformers_compat`), so such a card opens with the code to call.

:func:`model_card` is pure (strings in, a string out): :func:`~.hf_checkpoint.write_hf_checkpoint` builds the card
before any tensor is gathered and writes it inside the same all-or-nothing export.
"""

from __future__ import annotations

import re

from ..numerics import get_format
from . import four_over_six, transformers_compat
from .fused_mxfp4 import FILE_FORMAT, QUANT_METHOD
from .layer_schemes import resolve_schemes
from .schemes import LinearQuant, Scheme

__all__ = ["model_card", "CARD_FILE"]

CARD_FILE = "README.md"
_PRODUCER = "modelopt_moe"
_FORMAT_LABELS = {"compressed-tensors": "compressed-tensors", "modelopt": "NVIDIA Model Optimizer unified HF format",
                  "hf": "unquantized Hugging Face checkpoint",
                  FILE_FORMAT: "Hugging Face MXFP4 fused experts, the published gpt-oss layout"}


def model_card(*, architecture: str, fmt: str, linears: dict[str, LinearQuant], other_modules: list[str],
               dtype: str, name: str, base_model: str | None = None, packed: list[str] | None = None) -> str:
    """The ``README.md`` text of a checkpoint.

    Args:
        architecture: the Hugging Face architecture (``Qwen3MoeForCausalLM``).
        fmt: ``compressed-tensors``, ``modelopt``, ``hf`` or ``hf-mxfp4``.
        linears: every exported linear's Hugging Face module name -> its quantizers (as the exporter resolves them).
        other_modules: the Hugging Face module names of the other tensors (embeddings, norms), stored in ``dtype``.
        dtype: the dtype of every unquantized tensor (``bfloat16``).
        name: the checkpoint's name (its directory name), used in the loading code.
        base_model: the Hugging Face id of the model it was trained from, when known.
        packed: the fused expert weights stored in MXFP4 (``format="hf-mxfp4"``), by Hugging Face tensor name.

    Returns:
        Markdown with YAML front matter.

    Raises:
        ExportError: what :func:`~.layer_schemes.resolve_schemes` raises (a format that cannot express the
            quantizers).
    """
    schemes = resolve_schemes(linears, fmt)
    kinds = list(dict.fromkeys(s for s in schemes.values() if s is not None))
    if len(kinds) > 1:
        return _mixed_card(architecture, fmt, schemes, kinds, other_modules, dtype, name, base_model)
    scheme = kinds[0] if kinds else None
    if packed:
        return _fused_mxfp4_card(architecture, schemes, other_modules, packed, dtype, name, base_model)
    nvfp4_experts = _nvfp4_experts(fmt, schemes)
    title = f"{name}: {architecture}" + ("" if scheme is None else f", {scheme.name}")
    lines = [*_front_matter(fmt, kinds, base_model), "", f"# {title} ({_FORMAT_LABELS[fmt]})", ""]
    origin = f" from [{base_model}](https://huggingface.co/{base_model})" if base_model else ""
    lines += [f"A Mixture-of-Experts model ({architecture}){origin}, "
              + ("quantized (calibrated, and trained if QAT ran)" if scheme is not None else "trained")
              + f" in Megatron-Core with {_PRODUCER}, exported as {_format_sentence(fmt, scheme)}", ""]
    if nvfp4_experts:
        lines += _transformers_fix(name)
    lines += four_over_six.card_lines(schemes)
    lines += ["## Quantization per layer", ""]
    lines += _scheme_table(fmt, schemes, dtype)
    others = _patterns(other_modules)
    if others:
        lines += ["", f"Not quantized, stored in {dtype}: " + ", ".join(f"`{p}`" for p in others) + "."]
    if scheme is not None:
        lines += ["", *_tensors_sentence(fmt, scheme)]
    lines += ["", "## Readers", "", *_readers(fmt, scheme, nvfp4_experts)]
    return "\n".join(lines) + "\n"


def _fused_mxfp4_card(architecture: str, schemes: dict[str, Scheme | None], other_modules: list[str],
                      packed: list[str], dtype: str, name: str, base_model: str | None) -> str:
    """The card of a ``format="hf-mxfp4"`` checkpoint: MXFP4 fused experts, everything else unquantized."""
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation"]
    if base_model:
        lines += [f"base_model: {base_model}", "base_model_relation: quantized"]
    lines += ["tags:", *(f"- {t}" for t in ("quantized", QUANT_METHOD, "moe", _PRODUCER)), "---", "",
              f"# {name}: {architecture}, MXFP4 experts ({_FORMAT_LABELS[FILE_FORMAT]})", ""]
    origin = f" from [{base_model}](https://huggingface.co/{base_model})" if base_model else ""
    lines += [f"A Mixture-of-Experts model ({architecture}){origin}, its experts quantized to MXFP4 (and trained if "
              f"QAT ran) in Megatron-Core with {_PRODUCER}, exported in the layout of the published gpt-oss "
              f"checkpoints (`config.json`: `quantization_config.quant_method: {QUANT_METHOD}`).", "",
              "## Quantization per layer", "", *_scheme_table(FILE_FORMAT, schemes, dtype)]
    for pattern in _patterns(packed):
        modules = [p for p in packed if _pattern(p) == pattern]
        lines.append(f"| `{pattern}` | {_layers(modules)} | {len(modules)} | MXFP4: E2M1, E8M0 scale per block of 32 "
                     f"inputs | {dtype}, not quantized |")
    others = _patterns([m for m in other_modules if m not in packed])
    if others:
        lines += ["", f"Not quantized, stored in {dtype}: " + ", ".join(f"`{p}`" for p in others) + "."]
    lines += ["", "Tensors of each fused expert weight `[E, in, out]`: `<name>_blocks` uint8 `[E, out, in/32, 16]` "
              "(two E2M1 codes per byte, the even input in the low nibble) and `<name>_scales` uint8 `[E, out, in/32]` "
              "(E8M0: the value is `code * 2**(scale - 127)`), exactly the codes training's fake quantization rounded "
              "to.", "", "## Readers", "",
              "- transformers 5.23, `Mxfp4Config(dequantize=True)`: every expert weight exactly the trained fake "
              "quantization (its MXFP4 kernels need a GPU or the `kernels` package).",
              "- vLLM's gpt-oss loader (`quant_method: mxfp4`): the layout its loader reads (checked against its "
              "source, not run)."]
    return "\n".join(lines) + "\n"


def _fp8(scheme: Scheme) -> bool:
    """FP8 (E4M3) weights per tensor or channel with static input scales (the card's own text)."""
    return scheme.name.startswith("FP8")


def _nvfp4(scheme: Scheme) -> bool:
    return scheme.name.startswith("NVFP4")


def _nvfp4_experts(fmt: str, schemes: dict[str, Scheme | None]) -> bool:
    """compressed-tensors NVFP4 MoE experts: the ones transformers reads wrong without the fix."""
    return fmt == "compressed-tensors" and any(".experts." in m and s is not None and _nvfp4(s)
                                               for m, s in schemes.items())


def _mixed_card(architecture: str, fmt: str, schemes: dict[str, Scheme | None], kinds: list[Scheme],
                other_modules: list[str], dtype: str, name: str, base_model: str | None) -> str:
    """The card of a checkpoint whose linears carry several schemes (:mod:`.layer_schemes`)."""
    nvfp4_experts = _nvfp4_experts(fmt, schemes)
    title = f"{name}: {architecture}, " + " + ".join(k.name for k in kinds)
    lines = [*_front_matter(fmt, kinds, base_model), "", f"# {title} ({_FORMAT_LABELS[fmt]})", ""]
    origin = f" from [{base_model}](https://huggingface.co/{base_model})" if base_model else ""
    how = ("compressed-tensors (`config.json`: `quantization_config.quant_method: compressed-tensors`, `format: "
           "mixed-precision`, one config group per scheme with its own `format` and `targets`)."
           if fmt == "compressed-tensors" else
           "NVIDIA Model Optimizer's unified Hugging Face format (`config.json`: `quantization_config.quant_method: "
           "modelopt`, `quant_algo: MIXED_PRECISION` with every quantized linear's `quant_algo` in "
           "`quantized_layers`; the same in `hf_quant_config.json`).")
    lines += [f"A Mixture-of-Experts model ({architecture}){origin}, quantized (calibrated, and trained if QAT ran) "
              f"in Megatron-Core with {_PRODUCER}, each layer in its own scheme, exported as {how}", ""]
    if nvfp4_experts:
        lines += _transformers_fix(name)
    lines += four_over_six.card_lines(schemes)
    lines += ["## Quantization per layer", "", *_scheme_table(fmt, schemes, dtype)]
    others = _patterns(other_modules)
    if others:
        lines += ["", f"Not quantized, stored in {dtype}: " + ", ".join(f"`{p}`" for p in others) + "."]
    notes = []  # each scheme's tensors, then the notes they share (once)
    for k in kinds:
        first, *rest = _tensors_sentence(fmt, k)
        lines += ["", f"{k.name} linears: {first}"]
        notes += [n for n in rest if n]
    lines += [x for n in dict.fromkeys(notes) for x in ("", n)]
    by_line: dict[str, list[str]] = {}  # a reader's line -> the schemes it holds for
    for k in kinds:
        for line in _readers(fmt, k, nvfp4_experts):
            by_line.setdefault(line, []).append(k.name)
    readers = [line if len(ks) == len(kinds) else f"- {' and '.join(ks)} layers: {line[2:]}"
               for line, ks in by_line.items()]
    if fmt == "compressed-tensors":
        readers.append("- transformers 5.23 reads one scheme for all MoE experts (the group whose `re:` target "
                       "names `experts`) and one for every other linear (the first other group).")
    else:
        readers = [r for r in readers if not r.startswith("- vLLM (`quant_method: modelopt`)")]
        readers.insert(0, "- vLLM (`quant_algo: MIXED_PRECISION`: `ModelOptMixedPrecisionConfig`, FP8, NVFP4, "
                       "W4A16_NVFP4 and MXFP8 layers): the layout its loader reads (checked against its source, not "
                       "run). SGLang and TensorRT-LLM: not checked for per-layer schemes.")
    lines += ["", "## Readers", "", *readers]
    return "\n".join(lines) + "\n"


def _front_matter(fmt: str, kinds: list[Scheme], base_model: str | None) -> list[str]:
    tags = ["moe", _PRODUCER]
    if kinds:  # fp8 and / or nvfp4
        tags = ["quantized", *dict.fromkeys(k.name.split("_")[0].lower() for k in kinds), fmt, *tags]
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation"]
    if base_model:
        lines += [f"base_model: {base_model}", f"base_model_relation: {'quantized' if kinds else 'finetune'}"]
    return [*lines, "tags:", *(f"- {t}" for t in tags), "---"]


def _format_sentence(fmt: str, scheme: Scheme | None) -> str:
    if fmt == "compressed-tensors":
        return (f"compressed-tensors (`config.json`: `quantization_config.quant_method: compressed-tensors`, "
                f"`format: {scheme.ct_format}`).")
    if fmt == "modelopt":
        return (f"NVIDIA Model Optimizer's unified Hugging Face format (`config.json`: `quantization_config."
                f"quant_method: modelopt`, `quant_algo: {scheme.modelopt_algo}`; the same in `hf_quant_config.json`).")
    return "an unquantized Hugging Face checkpoint."


def _transformers_fix(name: str) -> list[str]:
    return [
        "> **transformers reads the MoE experts of this checkpoint wrong without a fix.** "
        f"Releases of {transformers_compat.AFFECTED_VERSIONS} dequantize "
        "NVFP4 MoE experts without their `weight_global_scale`: every expert weight comes out thousands of times too "
        "large, with no error or warning, and the logits are wrong (the top-1 token agrees with the trained model's "
        "almost nowhere). Attention and other dense layers load right. Apply the fix of the `modelopt_moe` package "
        "before loading (transformers >= 5.23):",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "from transformers.utils.quantization_config import CompressedTensorsConfig",
        "",
        "from modelopt_moe.export import transformers_compat",
        "",
        "fix = transformers_compat.fix_nvfp4_experts()  # once per process, before from_pretrained",
        f'model = AutoModelForCausalLM.from_pretrained("{name}",',
        "                                             quantization_config=CompressedTensorsConfig(dequantize=True))",
        "```",
        "",
        "It decodes every NVFP4 expert with compressed-tensors' own `NVFP4PackedCompressor.decompress`, the global "
        "scale included (`fix.remove()` undoes it).",
        "",
    ]


def _pattern(module: str) -> str:
    """``model.layers.3.mlp.experts.5.gate_proj`` -> ``model.layers.*.mlp.experts.*.gate_proj``."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", module)


def _patterns(modules: list[str]) -> list[str]:
    return list(dict.fromkeys(_pattern(m) for m in modules))


def _layers(modules: list[str]) -> str:
    """The layer indices of ``modules`` as ranges (``0-47``, ``0, 2-5``), or ``-`` for modules outside the layers."""
    found = sorted({int(m.group(1)) for m in (re.search(r"\blayers\.(\d+)\.", x) for x in modules) if m})
    if not found:
        return "-"
    ranges, start = [], found[0]
    for prev, cur in zip(found, [*found[1:], None], strict=True):
        if cur != prev + 1:
            ranges.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(ranges)


def _scheme_table(fmt: str, schemes: dict[str, Scheme | None], dtype: str) -> list[str]:
    rows: dict[tuple[str, Scheme | None], list[str]] = {}
    for module, s in schemes.items():
        rows.setdefault((_pattern(module), s), []).append(module)
    lines = ["| modules (Hugging Face names) | layers | count | weights | inputs (activations) |",
             "|---|---|---|---|---|"]
    for (pattern, scheme), modules in rows.items():
        weight, inputs = (_weights(fmt, scheme), _inputs(fmt, scheme, dtype)) if scheme is not None else (
            f"{dtype}, not quantized", f"{dtype}, not quantized")
        lines.append(f"| `{pattern}` | {_layers(modules)} | {len(modules)} | {weight} | {inputs} |")
    return lines


def _weights(fmt: str, scheme: Scheme) -> str:
    described = scheme.codec.describe(scheme, fmt)
    if described is not None:
        return described[0]
    if _fp8(scheme):
        return f"FP8 E4M3, fp32 scale per {'output channel' if scheme.per_channel else 'tensor'}"
    if four_over_six.four_over_six_weights(scheme):
        return "NVFP4: E2M1, E4M3 scale per block of 16 inputs chosen by 4-over-6, fp32 global scale"
    return "NVFP4: E2M1, E4M3 scale per block of 16 inputs, fp32 global scale"


def _inputs(fmt: str, scheme: Scheme, dtype: str) -> str:
    if not scheme.input_quantized:
        return f"{dtype}, not quantized (weight-only)"
    described = scheme.codec.describe(scheme, fmt)
    if described is not None:
        return described[1]
    if _fp8(scheme):
        return "FP8 E4M3, static fp32 scale per tensor"
    if four_over_six.four_over_six_inputs(scheme):
        return ("NVFP4 with 4-over-6: E4M3 scale per block of 16 computed at run time (max to 6 or 4), static fp32 "
                "global scale normalized to 256")
    return "NVFP4: E4M3 scale per block of 16 computed at run time, static fp32 global scale"


def _tensors_sentence(fmt: str, scheme: Scheme) -> list[str]:
    """The stored tensors of a quantized linear ``<m>`` and what their values are (amax: the value training used,
    each expert its own)."""
    described = scheme.codec.describe(scheme, fmt)
    if described is not None:
        return [f"Tensors of each quantized linear: {', '.join(described[2])} (the codes training rounded to). "
                "Scales that come from the data: no input scale is stored."]
    if _fp8(scheme):
        shape = "`[out, 1]`" if scheme.per_channel else ("`[1]`" if fmt == "compressed-tensors" else "`[]`")
        names = ["`weight` float8_e4m3fn", f"`weight_scale` fp32 {shape} = amax / 448"]
        if scheme.input_quantized:
            names.append("`input_scale` fp32 = input amax / 448")
    else:  # NVFP4, its weights' and inputs' second-level scales by their formats' bounds (2688; 4-over-6: 1536)
        wb = int(get_format(scheme.weight_fmt).bound)
        xb = int(get_format(scheme.input_fmt).bound) if scheme.input_quantized and scheme.input_fmt else wb
        if fmt == "modelopt":
            names = ["`weight` uint8 `[out, in/2]` (two E2M1 codes per byte, the even column in the low nibble)",
                     "`weight_scale` float8_e4m3fn `[out, in/16]`", f"`weight_scale_2` fp32 = amax / {wb}"]
            if scheme.input_quantized:
                names.append(f"`input_scale` fp32 = input amax / {xb}")
        else:
            names = ["`weight_packed` uint8 `[out, in/2]` (two E2M1 codes per byte, the even column in the low "
                     "nibble)", "`weight_scale` float8_e4m3fn `[out, in/16]`",
                     f"`weight_global_scale` fp32 = {wb} / amax"]
            if scheme.input_quantized:
                names.append(f"`input_global_scale` fp32 = {xb} / input amax")
    lines = [f"Tensors of each quantized linear: {', '.join(names)} (amax: the value training used, each expert its "
             "own). Gate and up projections of one expert share their second-level weight scale and input scale; so "
             "do q, k and v (the fused projections of serving engines need that)."]
    if scheme.input_quantized:
        lines += ["", "Input scales are stored per expert; some engines take one maximum per layer (vLLM FP8 MoE, "
                  "SGLang, TensorRT-LLM)."]
    return lines


def _readers(fmt: str, scheme: Scheme | None, nvfp4_experts: bool) -> list[str]:
    if scheme is None:
        return ["- Any reader of this architecture (`transformers`, vLLM, SGLang): nothing is quantized."]
    if scheme.codec.describe(scheme, fmt) is not None:
        if fmt == "compressed-tensors":
            return ["- transformers 5.23 + compressed-tensors 0.20, `CompressedTensorsConfig(dequantize=True)`, and "
                    "compressed-tensors' own decompressors: the codes training rounded to, decoded within 1 fp32 ulp "
                    "of the trained fake quantization (bit-exact where the scales are powers of two). transformers "
                    "runs the weights dequantized.",
                    "- vLLM and SGLang (compressed-tensors scheme): the layout their loaders read (checked against "
                    "their source, not run)."]
        return [f"- vLLM (`quant_method: modelopt`, `quant_algo: {scheme.modelopt_algo}`): the layout its loader "
                "reads (checked against its source, not run).",
                "- transformers has no `modelopt` quant_method; the same tensors under compressed-tensors' config "
                "load there (export with `format='compressed-tensors'`)."]
    if fmt == "compressed-tensors":
        if _fp8(scheme):
            tf = ("exact: every weight is `weight * weight_scale`, within 1 fp32 ulp of the trained fake "
                  "quantization")
        else:
            tf = ("**wrong for the MoE experts without the fix above**; with it, every expert weight within 1 bf16 "
                  "ulp of the trained fake quantization (compressed-tensors decodes NVFP4 to bf16)"
                  if nvfp4_experts else "within 1 bf16 ulp of the trained fake quantization")
        return [f"- transformers 5.23 + compressed-tensors 0.20, `CompressedTensorsConfig(dequantize=True)`: {tf}. "
                "It runs the weights dequantized and ignores input scales.",
                "- compressed-tensors' own decoders: the format's formula"
                + (", exact." if _fp8(scheme) else ", within 2 fp32 ulps of training."),
                "- vLLM (compressed-tensors scheme): the layout its loader reads (checked against its source, not "
                "run)."]
    lines = ["- vLLM (`quant_method: modelopt`), SGLang and TensorRT-LLM (`hf_quant_config.json`): the layouts their "
             "loaders read (checked against their source, not run)."]
    if not _fp8(scheme):
        lines += ["- `weight * weight_scale * weight_scale_2` (Model Optimizer's formula) is bit-exact with training.",
                  "- transformers has no `modelopt` quant_method: convert with compressed-tensors' "
                  "`ModelOptNvfp4Converter` (the result is a compressed-tensors checkpoint: for its MoE experts "
                  "transformers then needs `modelopt_moe.export.transformers_compat.fix_nvfp4_experts()`)."]
    else:
        lines += ["- transformers has no `modelopt` quant_method; these FP8 tensors carry compressed-tensors' names "
                  "and load exactly with a compressed-tensors `quantization_config`."]
    return lines
