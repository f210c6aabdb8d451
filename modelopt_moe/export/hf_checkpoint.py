"""Writing and reading Hugging Face checkpoints from canonical tensors (framework-free).

A framework adapter gathers its model's tensors and hands them over as canonical records (see
:mod:`.families`); :func:`write_hf_checkpoint` maps them to the family's names, encodes the quantized linears in the
chosen format (:mod:`.schemes`), writes shards, index and configs (:mod:`.writer`) with a progress bar per group
(one group per layer). :class:`HfCheckpointReader` reads a checkpoint's tensors by canonical name, lazily and in
slices, for import.

Distributed use: every rank calls :func:`write_hf_checkpoint` with the same arguments and iterates the same groups
(the adapter's collectives run inside the iteration); only the writer rank (global rank 0) receives tensors and
writes. Whatever fails (a non-empty output directory, a NaN weight) is agreed on by one broadcast from the writer
per group, so every rank raises the same :class:`~.errors.ExportError` and none waits in a collective.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..quantization.utils import warn_once
from . import four_over_six, fused_mxfp4, transformers_compat
from .calibration_coverage import CALIBRATION_TOKENS_FILE, DEFAULT_MIN_CALIB_TOKENS, calibration_tokens_json
from .errors import ExportError
from .families import Family, MoEArch, canonical_names, canonical_shapes, read_hf_config
from .kv_cache import KvCachePlan, KvCacheQuant, kv_cache_plan
from .layer_schemes import layers_hf_quant_config, layers_quantization_config, resolve_schemes
from .model_card import CARD_FILE, model_card
from .safetensors_files import check_tensors, read_weight_map
from .schemes import PRODUCER, LinearQuant, encode_linear, scheme_of
from .writer import CheckpointWriter, check_out_dir

__all__ = ["TensorRecord", "LinearRecord", "FusedMxfp4Record", "write_hf_checkpoint", "HfCheckpointReader", "DTYPES"]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class TensorRecord:
    """A tensor written as is (cast to the export dtype): embeddings, norms, the router."""

    canonical: str
    tensor: torch.Tensor


@dataclass
class LinearRecord:
    """A linear's full weight ``[out, in]`` and its quantization (amaxes as training used them)."""

    canonical: str
    weight: torch.Tensor
    quant: LinearQuant = field(default_factory=LinearQuant)
    weight_amax: torch.Tensor | None = None  # [] per tensor, [out] per channel
    input_amax: torch.Tensor | None = None  # []
    # Static two-level block scales (NVFP4 block_sizes.type: static): ([out, in // 16] block amaxes, normalization).
    weight_blocks: tuple[torch.Tensor, float] | None = None


@dataclass
class FusedMxfp4Record:
    """Every expert's weight of a fused 3-D expert tensor, ``[E, out, in]`` with the rows in the file's order, written
    in MXFP4 in the published layout (:mod:`.fused_mxfp4`: ``_blocks`` and ``_scales``)."""

    canonical: str
    weights: torch.Tensor


def _agree(error: str | None) -> str | None:
    """The writer rank's error (or None), on every rank: one broadcast, made by every rank unconditionally."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return error


def _is_writer() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def write_hf_checkpoint(out_dir: str | os.PathLike, *, arch: MoEArch, family: Family, fmt: str,
                        linear_quants: dict[str, LinearQuant], groups: Iterable[tuple[str, list]], num_groups: int,
                        dtype: torch.dtype | None = None, template: dict | None = None,
                        progress: bool = True, base_model: str | None = None,
                        kv_cache: list[KvCacheQuant] | None = None,
                        calibration_tokens: dict[str, int] | None = None, min_calib_tokens: int | None = None) -> Path:
    """Writes a Hugging Face checkpoint of ``arch`` in format ``fmt``, all or nothing, with its model card
    (``README.md``: the format, the quantization per layer, the readers known to be exact and any fix they need;
    :mod:`.model_card`).

    Args:
        out_dir: the output directory (must not exist, or be empty).
        arch: the model's architecture.
        family: the Hugging Face family to write.
        fmt: ``compressed-tensors``, ``modelopt``, ``hf`` (unquantized) or ``hf-mxfp4`` (MXFP4 fused experts).
        linear_quants: canonical name -> quantizers, for every linear (known before any tensor is gathered, so a
            scheme the format cannot express fails before writing).
        groups: ``(label, records)`` per layer; records are :class:`TensorRecord` / :class:`LinearRecord` (on ranks
            other than the writer: anything, ignored). Iterated on every rank.
        num_groups: the number of groups (for the progress bar).
        dtype: the dtype of unquantized tensors (default: ``arch.dtype``, the model's parameter dtype; norms built in
            fp32 by the framework are cast to it too). ``config.json`` names it.
        template: a Hugging Face config whose other keys (token ids, generation settings) are kept.
        progress: show a progress bar (writer rank only).
        base_model: the Hugging Face id of the model it was trained from, for the model card (when known).
        kv_cache: each layer's KV-cache quantizers (:mod:`.kv_cache`; its ``k_scale`` / ``v_scale`` are written
            by the writer rank, the same on every rank).
        calibration_tokens: canonical expert linear -> the calibration tokens of its input (the same on every
            rank); written as ``calibration_tokens.json`` by Hugging Face name, with ``min_calib_tokens``
            (:mod:`.calibration_coverage`), in quantized formats.
        min_calib_tokens: the token count below which the export warned (default: the export's default).

    Returns:
        The output directory.

    Raises:
        ExportError: on every rank, before anything is written: an unsupported format, family or feature, a model
            that is not quantized, a scheme the format cannot express, a non-empty output directory; and, with the
            temporary directory removed, a tensor that cannot be encoded.

    Warns (once per process, on global rank 0) after writing NVFP4 experts in compressed-tensors format: some
    transformers releases read them wrong (:mod:`.transformers_compat` has the fix); and after writing linears whose
    inputs were trained with NVFP4 4-over-6 block scales: the engine setting they need (:mod:`.four_over_six`).
    """
    error = None
    try:
        arch, dtype, config, schemes, ignore = _plan(arch, family, fmt, linear_quants, dtype, template)
        kv = _plan_kv_cache(kv_cache, fmt, arch, family, schemes, config)
        card = model_card(architecture=family.architecture, fmt=fmt,
                          linears={family.hf_module(c): q for c, q in linear_quants.items()},
                          other_modules=[family.hf_module(c) for c in canonical_names(arch) if c not in linear_quants],
                          dtype=arch.dtype, name=Path(out_dir).name, base_model=base_model,
                          packed=_packed(arch, family) if fmt == fused_mxfp4.FILE_FORMAT else None)
        if _is_writer():
            check_out_dir(out_dir)
    except ExportError as e:
        error = str(e)
    _raise_agreed(error)

    expected, seen = set(canonical_names(arch)), set()
    writer = None
    try:
        error = None
        if _is_writer():
            try:
                writer = CheckpointWriter(out_dir)
            except OSError as e:
                error = f"cannot create a temporary directory beside {out_dir}: {e}"
        _raise_agreed(error)
        bar = _progress(num_groups, progress and writer is not None)
        for label, records in groups:
            error = None
            for rec in records:  # every rank iterates: the adapter's collectives run here
                if writer is not None and error is None:
                    try:
                        _write_record(writer, family, rec, schemes, fmt, dtype, expected, seen)
                    except Exception as e:  # noqa: BLE001  (every rank must learn of it, whatever it is)
                        error = f"{label}: {e}" if isinstance(e, ExportError) else f"{label}: {type(e).__name__}: {e}"
            _raise_agreed(error)
            if bar is not None:
                bar.set_postfix_str(label)
                bar.update(1)
        if bar is not None:
            bar.close()
        error = None
        if writer is not None:
            tokens = {family.hf_module(c): n for c, n in (calibration_tokens or {}).items()}
            extra = {CALIBRATION_TOKENS_FILE: calibration_tokens_json(
                tokens, DEFAULT_MIN_CALIB_TOKENS if min_calib_tokens is None else min_calib_tokens, PRODUCER)} \
                if tokens and fmt != "hf" else {}
            error = _commit(writer, config, schemes, ignore, fmt, sorted(expected - seen), family, card, kv, extra)
        _raise_agreed(error)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if fmt == "compressed-tensors" and _has_nvfp4_experts(schemes):
        warn_once(NVFP4_EXPERTS_WARNING)
    served = four_over_six.served_setting_warning(schemes, fmt)
    if served is not None:
        warn_once(served)
    coarse = [n for n, q in ((family.hf_module(c), q) for c, q in linear_quants.items())
              if schemes.get(n) is not None and schemes[n].dynamic_input and q.input is not None
              and q.input.dynamic and not q.input.per_token and q.input.block_size is None]
    if coarse:
        warn_once(f"export_hf: {len(coarse)} linears (e.g. {coarse[0]}) trained their inputs with one dynamic amax per "
                  f"tensor and are written as {schemes[coarse[0]].name}, whose engines quantize inputs per token (a "
                  "finer scale: the weights are exactly the trained ones, the input rounding is not)")
    return Path(out_dir)


NVFP4_EXPERTS_WARNING = (
    "export_hf wrote NVFP4 MoE experts in compressed-tensors format: "
    f"{transformers_compat.AFFECTED_VERSIONS} dequantize these experts without their weight_global_scale and give "
    "wrong logits without any error. Before loading the checkpoint with transformers, call "
    "modelopt_moe.export.transformers_compat.fix_nvfp4_experts() (transformers>=5.23). See docs/export.md, "
    "'Which readers are exact'.")


def _packed(arch: MoEArch, family: Family) -> list[str]:
    """The Hugging Face names of the tensors ``format="hf-mxfp4"`` packs (every fused expert weight)."""
    kinds = fused_mxfp4.check_family(family)
    return [family.hf_tensor(c) for c in canonical_names(arch) if c.rsplit(".", 1)[-1] in kinds]


def _has_nvfp4_experts(schemes: dict) -> bool:
    return any(".experts." in name and s is not None and s.ct_format == transformers_compat.AFFECTED_FORMAT
               for name, s in schemes.items())


def _plan(arch: MoEArch, family: Family, fmt: str, linear_quants: dict[str, LinearQuant], dtype, template):
    """Everything known before any tensor: the export dtype, ``config.json``, each linear's scheme (by Hugging Face
    name) and the excluded linears."""
    if dtype is not None:
        arch = replace(arch, dtype=str(dtype).replace("torch.", ""))
    if arch.dtype not in DTYPES:
        raise ExportError(f"dtype {arch.dtype!r}: expected one of {sorted(DTYPES)}")
    if fmt == fused_mxfp4.FILE_FORMAT:
        _packed(arch, family)  # a family with fused 3-D experts, before its linears are judged
    config = family.hf_config(arch, template)
    hf_quants = {family.hf_module(c): q for c, q in linear_quants.items()}
    schemes = resolve_schemes(hf_quants, fmt)
    ignore = [name for name, s in schemes.items() if s is None]
    if fmt == fused_mxfp4.FILE_FORMAT:
        not_converted = [family.hf_module(c) for c in canonical_names(arch) if c.rsplit(".", 1)[-1] in
                         ("embed_tokens", "lm_head")] + ignore
        config["quantization_config"] = fused_mxfp4.quantization_config(
            list(dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".*", m) for m in not_converted)))
    elif fmt != "hf":
        config["quantization_config"] = layers_quantization_config(_quantized(schemes), fmt, ignore)
        marker = four_over_six.marker(schemes)
        if marker is not None:
            config["quantization_config"][four_over_six.MARKER_KEY] = marker
    return arch, DTYPES[arch.dtype], config, schemes, ignore


def _quantized(schemes: dict) -> dict:
    return {name: s for name, s in schemes.items() if s is not None}


def _plan_kv_cache(kv_cache: list[KvCacheQuant] | None, fmt: str, arch: MoEArch, family: Family, schemes: dict,
                   config: dict) -> KvCachePlan | None:
    """The KV cache's plan, its entries added to ``config``'s ``quantization_config`` (single-scheme and per-layer
    configs alike; ``hf``: none, with a warning where the model quantizes its KV cache)."""
    if fmt in ("hf", fused_mxfp4.FILE_FORMAT):
        if any(q.k_fmt or q.v_fmt for q in kv_cache or []):
            warn_once(f"export_hf(format={fmt!r}) writes no KV-cache quantization: the KV cache's k_scale / v_scale "
                      "are left out")
        return None
    kv = kv_cache_plan(kv_cache or [], fmt)
    if kv is not None:
        if not _quantized(schemes):
            raise ExportError(f"format={fmt!r}: the model quantizes its KV cache but none of its linears; a KV cache "
                              "is exported beside quantized linears")
        names = set(canonical_names(arch))
        if not {"layers.0.k_proj", "layers.0.v_proj"} <= names:
            raise ExportError(f"format={fmt!r}: the model quantizes its KV cache, but {family.architecture} has no "
                              "k_proj / v_proj to carry k_scale / v_scale (multi-latent attention caches a latent): "
                              "KV-cache export takes grouped-query attention; disable the *[kv]_bmm_quantizer rules")
        config["quantization_config"].update(kv.config_entries(fmt))
    return kv


def _commit(writer: CheckpointWriter, config: dict, schemes: dict, ignore: list[str], fmt: str, missing: list[str],
            family: Family, card: str, kv: KvCachePlan | None = None, more: dict | None = None) -> str | None:
    """Writer rank: the final files (``more``: other JSON files by name) and the rename; returns an error to agree
    on (or None)."""
    if missing:
        return f"the adapter gave no tensor for {len(missing)} names of {family.architecture}, e.g. {missing[:3]}"
    extra = {"hf_quant_config.json": layers_hf_quant_config(_quantized(schemes), ignore)} if fmt == "modelopt" \
        else {}
    extra.update(more or {})
    marker = config.get("quantization_config", {}).get(four_over_six.MARKER_KEY)  # _plan's, for config.json
    if marker is not None and "hf_quant_config.json" in extra:
        # beside "producer": the engines read "quantization"
        extra["hf_quant_config.json"][four_over_six.MARKER_KEY] = marker
    if kv is not None:
        if "hf_quant_config.json" in extra:
            extra["hf_quant_config.json"]["quantization"].update(kv.config_entries(fmt))
        try:
            for L in range(len(kv.amax)):
                for name, tensor in kv.tensors(L, family.hf_module(f"layers.{L}.k_proj"),
                                               family.hf_module(f"layers.{L}.v_proj"), fmt).items():
                    writer.add(name, tensor)
        except ExportError as e:
            return f"KV cache scales: {e}"
    try:
        writer.commit(config, extra, {CARD_FILE: card})
    except OSError as e:
        return f"writing {writer.out_dir} failed: {e}"
    return None


def _raise_agreed(error: str | None) -> None:
    """Raises the writer rank's error on every rank (one broadcast, made by every rank)."""
    error = _agree(error)
    if error is not None:
        raise ExportError(error)


def _progress(total: int, enabled: bool):
    from ..progress import progress  # a bar on a terminal, periodic lines in a log

    return progress(total, "export", unit="layers", enabled=enabled)


def _write_record(writer: CheckpointWriter, family: Family, rec, schemes: dict, fmt: str, dtype, expected: set,
                  seen: set) -> None:
    if rec.canonical not in expected:
        raise ExportError(f"{rec.canonical} is not a tensor of this {family.architecture} model")
    if rec.canonical in seen:
        raise ExportError(f"{rec.canonical} given twice")
    seen.add(rec.canonical)
    if isinstance(rec, FusedMxfp4Record):
        if fmt != fused_mxfp4.FILE_FORMAT:
            raise ExportError(f"{family.hf_tensor(rec.canonical)}: MXFP4 fused experts are written with "
                              f"format={fused_mxfp4.FILE_FORMAT!r}, not {fmt!r}")
        name = family.hf_tensor(rec.canonical)
        for suffix, tensor in zip(fused_mxfp4.SUFFIXES, fused_mxfp4.encode_experts(rec.weights, name), strict=True):
            writer.add(name + suffix, tensor)
        return
    module = family.hf_module(rec.canonical)
    scheme = schemes.get(module)
    if isinstance(rec, LinearRecord) and scheme is not None:
        if scheme_of(rec.quant, module) != scheme:  # the records must be quantized as the plan (and config) says
            raise ExportError(f"{module}: the adapter gave quantizers {rec.quant}, planned as {scheme.name}")
        for name, tensor in encode_linear(module, rec.weight, rec.weight_amax, rec.input_amax, scheme, fmt,
                                         weight_blocks=rec.weight_blocks).items():
            writer.add(name, tensor)
        return
    tensor = rec.weight if isinstance(rec, LinearRecord) else rec.tensor
    writer.add(family.hf_tensor(rec.canonical), tensor.to(family.tensor_dtype(rec.canonical, dtype)))


class HfCheckpointReader:
    """The tensors of an unquantized Hugging Face checkpoint (``model.safetensors`` or sharded with an index), read
    by canonical name, lazily (one tensor or one slice at a time: memory stays bounded). A checkpoint whose fused 3-D
    experts are stored in the published MXFP4 layout (``quant_method: mxfp4``, gpt-oss; :mod:`.fused_mxfp4`) is read
    too: those experts come dequantized, exactly, in fp32.

    Construction checks everything the files can tell without reading tensor data: the config, the index, and the
    header of every shard (each tensor present where the index places it, with the shape the config implies and a
    float dtype, every file as long as its header says): a broken checkpoint is refused before any tensor is read.

    Args:
        hf_dir: the model directory.

    Raises:
        ExportError: no config or safetensors, an unsupported architecture, a quantized checkpoint (other than MXFP4
            fused experts), tensors that do not match the config (names the missing and unexpected tensors), or shard
            files that do not hold what the index and config say (names the file, the tensor, what was expected and
            found).
    """

    def __init__(self, hf_dir: str | os.PathLike):
        from .families import family_for_architecture

        self.path = Path(hf_dir)
        self.config = read_hf_config(self.path)
        self.family = family_for_architecture(self.config)
        packable = self._packable_kinds()
        self.arch = self.family.arch_from_hf(self.config)
        weight_map = read_weight_map(self.path)
        self._files: dict[str, str] = {}
        self._packed: dict[str, dict[str, str]] = {}  # canonical -> suffix -> file (MXFP4 fused experts)
        expected = set(canonical_names(self.arch))
        unexpected = []
        for name, file in weight_map.items():
            canonical = self.family.canonical_tensor(name)
            suffix = next((x for x in fused_mxfp4.SUFFIXES if name.endswith(x)), None)
            stem = self.family.canonical_tensor(name.removesuffix(suffix)) if canonical is None and suffix else None
            if canonical in expected:
                self._files[canonical] = file
            elif stem in expected and stem.rsplit(".", 1)[-1] in packable:
                self._packed.setdefault(stem, {})[suffix] = file
            elif not (canonical == "lm_head" and self.arch.tie_word_embeddings):  # tied copies are allowed
                unexpected.append(name)
        halves = [f"{self.family.hf_tensor(c)}{x} without {self.family.hf_tensor(c)}{y}" for c, parts in
                  self._packed.items() for x, y in (fused_mxfp4.SUFFIXES, fused_mxfp4.SUFFIXES[::-1])
                  if x in parts and y not in parts]
        if halves:
            raise ExportError(f"{self.path}: MXFP4 fused experts come as _blocks and _scales pairs: "
                              f"{', '.join(halves[:3])}{' ...' if len(halves) > 3 else ''}")
        unexpected += [self.family.hf_tensor(c) + x for c in self._packed if c in self._files for x in self._packed[c]]
        self._packed = {c: self._packed[c] for c in self._packed if c not in self._files}
        missing = sorted(expected - set(self._files) - set(self._packed))
        if missing or unexpected:
            raise ExportError(f"{self.path}: the tensors do not match {self.family.architecture} with config "
                              f"{self.arch}: missing {[self.family.hf_tensor(m) for m in missing[:5]]}"
                              f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                              f"{' ...' if len(unexpected) > 5 else ''}")
        shapes = canonical_shapes(self.arch)
        self._headers = check_tensors(self.path, weight_map,
                                      {self.tensor_name(c): shapes[c] for c in self._files})
        packed_shapes = {}
        for c in self._packed:
            for suffix, shape in zip(fused_mxfp4.SUFFIXES, fused_mxfp4.packed_shapes(shapes[c]), strict=True):
                packed_shapes[self.tensor_name(c) + suffix] = shape
        check_tensors(self.path, weight_map, packed_shapes, dtypes=("U8",))

    def _packable_kinds(self) -> frozenset[str]:
        """The tensor kinds the config says are stored packed: none for an unquantized checkpoint, the family's
        fused expert weights for ``quant_method: mxfp4``; refuses any other quantization."""
        qc = self.config.get("quantization_config")
        if qc is None:
            return frozenset()
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        kinds = fused_mxfp4.packed_kinds(self.family) if method == fused_mxfp4.QUANT_METHOD else frozenset()
        if not kinds:
            raise ExportError(f"{self.path}: a quantized checkpoint (quant_method={method!r}); import reads "
                              "unquantized (bf16 / fp16 / fp32) checkpoints, and MXFP4 fused 3-D experts (quant_method "
                              f"{fused_mxfp4.QUANT_METHOD!r}) of families that store them so (gpt-oss), not "
                              f"{self.family.architecture}")
        return kinds

    def _read(self, canonical: str, index):
        """``index`` (a slice tuple, or None for the whole tensor) of a tensor, errors naming the file and tensor."""
        from safetensors import safe_open

        if canonical in self._packed:
            return self._read_packed(canonical, index)
        path, name = self.path / self._files[canonical], self.tensor_name(canonical)
        try:
            with safe_open(str(path), "pt") as f:
                return f.get_tensor(name) if index is None else f.get_slice(name)[index]
        except Exception as e:  # noqa: BLE001  (the safetensors error and OSError alike name no file)
            raise ExportError(f"{path}: reading tensor {name} failed: {type(e).__name__}: {e}") from e

    def _read_packed(self, canonical: str, index):
        """An MXFP4 fused expert weight, dequantized to fp32 ``[E, in, out]`` (only the experts a slice along dim 0
        asks for are read)."""
        from safetensors import safe_open

        experts = index[0] if index is not None and len(index) == 1 else slice(None)
        parts = []
        for suffix in fused_mxfp4.SUFFIXES:
            path, name = self.path / self._packed[canonical][suffix], self.tensor_name(canonical) + suffix
            try:
                with safe_open(str(path), "pt") as f:
                    parts.append(f.get_slice(name)[experts])
            except Exception as e:  # noqa: BLE001  (the safetensors error and OSError alike name no file)
                raise ExportError(f"{path}: reading tensor {name} failed: {type(e).__name__}: {e}") from e
        full = fused_mxfp4.decode_experts(*parts, self.tensor_name(canonical)).transpose(1, 2)
        return full if index is None or len(index) == 1 else full[index]

    def tensor_name(self, canonical: str) -> str:
        """The Hugging Face tensor name of the canonical tensor ``canonical``."""
        return self.family.hf_tensor(canonical)

    def get(self, canonical: str) -> torch.Tensor:
        """The whole tensor."""
        return self._read(canonical, None)

    def shape(self, canonical: str) -> tuple[int, ...]:
        """The tensor's shape, from the safetensors header (nothing is read)."""
        if canonical in self._packed:
            return canonical_shapes(self.arch)[canonical]
        return self._headers[self.tensor_name(canonical)].shape

    def get_slice(self, canonical: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Indices ``start:stop`` along ``dim`` (any rank of tensor), read without loading the rest."""
        return self._read(canonical, (slice(None),) * dim + (slice(start, stop),))

    def get_rows(self, canonical: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (dim 0), read without loading the rest."""
        return self.get_slice(canonical, 0, start, stop)

    def get_cols(self, canonical: str, start: int, stop: int) -> torch.Tensor:
        """Columns ``start:stop`` (dim 1)."""
        return self.get_slice(canonical, 1, start, stop)

    def names(self) -> Iterator[str]:
        """The canonical names of the checkpoint's tensors."""
        return iter(self._files)
