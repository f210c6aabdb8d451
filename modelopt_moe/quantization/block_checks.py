"""What 2-D weight blocks (``block_sizes: {-1: cols, -2: rows}``) cannot do, found when quantizers are configured:
a 2-D block on an input or output quantizer (token matrices are quantized per token, in groups of the last dim), and
a tensor-parallel split of the weight that would cut its blocks (each shard would then scale a partial block of its
own, which no single-rank model or checkpoint reader does). A weight whose dims are not multiples of the block on one
rank is fine: its last blocks are partial, zero-padded (numerics/blocks.py), as engines lay out such scales.
"""

from __future__ import annotations

__all__ = ["block_2d_problems", "tp_sizes_that_keep_blocks"]

_MAX_TP = 64


def tp_sizes_that_keep_blocks(full: int, block: int) -> list[int]:
    """The TP sizes (up to 64) that split a dim of ``full`` into equal shards of whole ``block`` s (1 always)."""
    return [t for t in range(1, _MAX_TP + 1) if full % t == 0 and (t == 1 or (full // t) % block == 0)]


def block_2d_problems(name: str, kind: str, block: tuple[int, int], local_shape: tuple[int, ...],
                      split: tuple[int, int] | None) -> list[str]:
    """Why the quantizer ``name`` (of ``kind``: ``weight_quantizer``, ``input_quantizer``, ``output_quantizer``) with
    2-D blocks ``(rows, cols)`` cannot work on its module; empty where it can.

    Args:
        name: the quantizer's full name (messages name it).
        kind: which operand it quantizes.
        block: ``(rows, cols)``.
        local_shape: this rank's weight shape.
        split: ``(weight axis, size)`` of the module's tensor-parallel split, or None (not split).
    """
    rows, cols = block
    if kind != "weight_quantizer":
        operand = kind.removesuffix("_quantizer")
        return [f"{name}: 2-D blocks {{-1: {cols}, -2: {rows}}} apply to weights only; an {operand} is a token "
                f"matrix, quantized per token in groups of its last dim: use block_sizes {{-1: {cols}}} with "
                "type: dynamic"]
    if len(local_shape) != 2:
        return [f"{name}: 2-D blocks {{-1: {cols}, -2: {rows}}} need a 2-D weight, got shape {local_shape}"]
    if split is None or split[1] <= 1:
        return []
    axis, size = split
    length = (rows, cols)[axis]
    if local_shape[axis] % length == 0:
        return []
    full_shape = tuple(n * size if a == axis else n for a, n in enumerate(local_shape))
    full = full_shape[axis]
    return [f"{name}: the weight of shape {full_shape} split over tensor-parallel size {size} along axis {axis} gives "
            f"shards of {local_shape[axis]}, which cut its 2-D blocks of {length} along that axis (every shard must "
            f"hold whole blocks); tensor-parallel sizes that work: {tp_sizes_that_keep_blocks(full, length)}"]
