"""Columns of the per-expert table the grouped weight kernels read (int64 ``[N, NCOL]``, one row per expert).

Plain Python, imported both by the launchers that fill the table and by the ``@triton.jit`` code that reads it.
"""

COL_IN = 0  # element offset of the input (forward) / gradient (backward) from its base tensor
COL_AUX = 1  # element offset of the weight from its base tensor (backward only)
COL_OUT = 2  # element offset of this expert in the output buffer
COL_ROWS = 3
COL_COLS = 4
COL_TILE0 = 5  # first program id of this expert (cumulative tile count)
COL_CTILES = 6  # column tiles per row tile (2-D tiling only)
NCOL = 8  # one spare column keeps rows 64-byte aligned
