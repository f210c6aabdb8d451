"""Precomputed teacher logits: the teacher's top-k per token, written once to disk and streamed during QAD.

A second epoch, or a second student distilled from the same teacher on the same data, then costs no teacher
forward and holds no teacher weights. Per token the store keeps the teacher's ``k`` largest logits over the whole
vocabulary (values in bf16, fp16 or fp32) and their vocabulary ids (int32): ``6 k`` bytes a token in bf16.

On disk, a directory::

    manifest.json         what the store holds (format, k, vocabulary, value dtype, batches, their token hashes,
                          the shards with their batches and byte sizes)
    shard-00000.pt ...    torch files, each a list of ``{"values": [..., w], "indices": [..., w] int32}`` per batch
                          (``w = k``, or more where logits tie with the k-th largest, padded with -inf and id -1)

Written all or nothing: into a temporary directory beside the target, renamed into place at the end (a store of
ours already there is replaced only then; anything else there is refused before the teacher runs).

Read back, :class:`TeacherLogitsStore` checks the manifest, every shard's size, and, given the batches a run will
use, their tokens and order, before any step; :class:`StoredTeacherLogits` is a module that stands where the teacher
stood in :class:`~modelopt_moe.distill.DistillationModel`: given a batch's tokens it checks them against the store
and returns the teacher's logits as the top-k KL reads them (the stored values at their ids, ``-inf`` elsewhere, this
rank's vocabulary slice), so the loss is the top-k KL of the live teacher (``logits_kl_loss(..., top_k=k)``), the
same numbers when the values are stored in the teacher logits' dtype (ties with the ``k``-th largest logit are
stored too, as the top-k KL keeps them).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["LogitStoreError", "TeacherLogitsWriter", "TeacherLogitsStore", "StoredTeacherLogits", "token_digest",
           "global_top_k"]

FORMAT, VERSION, MANIFEST = "modelopt_moe.teacher_logits", 1, "manifest.json"
VALUE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class LogitStoreError(ValueError):
    """A teacher-logits store that cannot be written or does not fit the run (names the file and the field)."""


def token_digest(tokens: torch.Tensor) -> str:
    """SHA-256 of a batch's token ids (shape and int64 values): what identifies a batch in the store."""
    t = tokens.detach().to("cpu", torch.int64).contiguous()
    h = hashlib.sha256(repr(tuple(t.shape)).encode())
    h.update(t.numpy().tobytes())
    return h.hexdigest()


def _tp(group) -> tuple[int, int]:
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def global_top_k(logits: torch.Tensor, k: int, tp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest logits of every token over the whole vocabulary, and their vocabulary ids (int64).

    ``logits`` is ``[..., V]`` or, with ``tp_group``, this rank's contiguous slice ``[..., V / tp]`` (rank ``r``
    holds ids ``[r V / tp, (r + 1) V / tp)``, Megatron's vocab-parallel layout): each rank's top ``k`` are
    gathered over the group (every rank calls it, whatever the data) and the same result is returned on all.
    """
    rank, size = _tp(tp_group)
    local = logits.shape[-1]
    values, ids = logits.topk(min(k, local), dim=-1)
    ids = ids + rank * local
    if values.shape[-1] < k:  # a shard smaller than k: pad so that every rank gathers the same shape
        pad = (*values.shape[:-1], k - values.shape[-1])
        values = torch.cat([values, values.new_full(pad, float("-inf"))], -1)
        ids = torch.cat([ids, ids.new_zeros(pad)], -1)
    if size > 1:
        parts_v = [torch.empty_like(values) for _ in range(size)]
        parts_i = [torch.empty_like(ids) for _ in range(size)]
        dist.all_gather(parts_v, values.contiguous(), group=tp_group)
        dist.all_gather(parts_i, ids.contiguous(), group=tp_group)
        values, ids = torch.cat(parts_v, -1), torch.cat(parts_i, -1)
        values, pos = values.topk(k, dim=-1)
        ids = ids.gather(-1, pos)
    return values, ids


def _dtype_name(dtype: torch.dtype) -> str:
    for name, d in VALUE_DTYPES.items():
        if d == dtype:
            return name
    raise LogitStoreError(f"teacher logits store: values_dtype={dtype}; expected one of "
                          f"{[str(d) for d in VALUE_DTYPES.values()]}")


def _is_store(path: Path) -> bool:
    try:
        return json.loads((path / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


class TeacherLogitsWriter:
    """Writes a store batch by batch: ``add(tokens, teacher_logits)`` for every batch, then ``commit()``.

    Every rank of ``tp_group`` calls ``add`` (the top k is gathered over it); only the ranks with ``write=True``
    (one per data-parallel replica) write files. Nothing appears at ``directory`` before ``commit``.

    Args:
        directory: the store to write; absent, empty, or a store of ours (replaced at ``commit``).
        top_k: logits kept per token.
        values_dtype: dtype of the stored values (bf16, fp16 or fp32; the teacher logits' dtype keeps them exact).
        tp_group: the group the logits' vocabulary is split over (None: not split).
        batches_per_shard: batches in one shard file.
        write: whether this rank writes (the others only take part in the gathers).
        extra: JSON-serialisable facts recorded in the manifest (e.g. the data-parallel rank).

    Raises:
        LogitStoreError: ``directory`` holds something that is not a teacher-logits store; a bad ``top_k``,
            ``values_dtype`` or ``batches_per_shard``.
    """

    def __init__(self, directory: str | os.PathLike, *, top_k: int, values_dtype: torch.dtype = torch.bfloat16,
                 tp_group=None, batches_per_shard: int = 64, write: bool = True, extra: dict | None = None):
        self.directory = Path(directory)
        for name, value in (("top_k", top_k), ("batches_per_shard", batches_per_shard)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LogitStoreError(f"teacher logits store {self.directory}: {name}={value!r}; expected a positive "
                                      "integer")
        # checked on every rank (the same files), so that all stop together before the teacher runs
        if self.directory.exists() and (not self.directory.is_dir() or (
                any(self.directory.iterdir()) and not _is_store(self.directory))):
            raise LogitStoreError(f"teacher logits store {self.directory}: exists and is not a teacher-logits store "
                                  f"(no {MANIFEST} of format {FORMAT!r}); refusing to replace it")
        self.top_k, self.tp_group, self.write = top_k, tp_group, write
        self.values_dtype, self._dtype_name = values_dtype, _dtype_name(values_dtype)
        self.batches_per_shard, self.extra = batches_per_shard, dict(extra or {})
        self._pending: list[dict[str, torch.Tensor]] = []
        self._shards: list[dict] = []
        self._digests: list[str] = []
        self._shapes: list[list[int]] = []
        self._vocab: int | None = None
        self._tmp: Path | None = None
        if write:
            self.directory.parent.mkdir(parents=True, exist_ok=True)
            self._tmp = self.directory.parent / f".{self.directory.name}.tmp-{os.getpid()}"
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp.mkdir()

    def add(self, tokens: torch.Tensor, teacher_logits: torch.Tensor) -> None:
        """Records one batch: its tokens' digest and the teacher's global top k of ``teacher_logits``
        (``[*tokens.shape, V]`` or this rank's vocabulary slice of it)."""
        if tuple(teacher_logits.shape[:-1]) != tuple(tokens.shape):
            raise LogitStoreError(f"teacher logits store {self.directory}: batch {len(self._digests)}: logits "
                                  f"{tuple(teacher_logits.shape)} do not match tokens {tuple(tokens.shape)}")
        vocab = teacher_logits.shape[-1] * _tp(self.tp_group)[1]
        if self._vocab is not None and vocab != self._vocab:
            raise LogitStoreError(f"teacher logits store {self.directory}: batch {len(self._digests)}: vocabulary "
                                  f"{vocab}, the batches before had {self._vocab}")
        if vocab < self.top_k:
            raise LogitStoreError(f"teacher logits store {self.directory}: top_k={self.top_k} exceeds the "
                                  f"vocabulary ({vocab})")
        self._vocab = vocab
        logits = teacher_logits.detach()
        # The top-k KL keeps every logit tied with the k-th largest: so does the store (a batch's rows are as wide
        # as its most tied token's; the other rows end in padding, value -inf and id -1).
        kth = global_top_k(logits, self.top_k, self.tp_group)[0][..., -1:]
        ties = (logits >= kth).sum(-1)
        if _tp(self.tp_group)[1] > 1:
            dist.all_reduce(ties, group=self.tp_group)
        values, ids = global_top_k(logits, max(self.top_k, int(ties.max()) if ties.numel() else 0), self.tp_group)
        beyond = values < kth
        values, ids = values.masked_fill(beyond, float("-inf")), ids.masked_fill(beyond, -1)
        self._digests.append(token_digest(tokens))
        self._shapes.append(list(tokens.shape))
        if self.write:
            self._pending.append({"values": values.to("cpu", self.values_dtype).contiguous(),
                                  "indices": ids.to("cpu", torch.int32).contiguous()})
            if len(self._pending) == self.batches_per_shard:
                self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        name = f"shard-{len(self._shards):05d}.pt"
        torch.save(self._pending, self._tmp / name)
        first = sum(s["count"] for s in self._shards)
        self._shards.append({"file": name, "first": first, "count": len(self._pending),
                             "bytes": (self._tmp / name).stat().st_size})
        self._pending = []

    def commit(self) -> Path | None:
        """Writes the last shard and the manifest and moves the store into place (on writing ranks).

        Returns:
            The store's directory on a writing rank, None on the others.
        """
        if not self._digests:
            self.abort()
            raise LogitStoreError(f"teacher logits store {self.directory}: no batch was added; nothing to write")
        if not self.write:
            return None
        try:
            self._flush()
            manifest = {"format": FORMAT, "version": VERSION, "top_k": self.top_k, "vocab_size": self._vocab,
                        "values_dtype": self._dtype_name, "batches": len(self._digests),
                        "tokens_sha256": self._digests, "tokens_shape": self._shapes, "shards": self._shards,
                        **self.extra}
            (self._tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            old = None
            if self.directory.exists():
                old = self.directory.parent / f".{self.directory.name}.old-{os.getpid()}"
                self.directory.rename(old)
            self._tmp.rename(self.directory)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            self.abort()
            raise
        return self.directory

    def abort(self) -> None:
        """Removes what was written (the target is left as it was)."""
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


class TeacherLogitsStore:
    """A store written by :class:`TeacherLogitsWriter`, checked when opened and read one shard at a time.

    Args:
        directory: the store.
        top_k: the ``k`` the run expects (None: any).
        vocab_size: the whole vocabulary the run's logits cover (None: any).
        batches: the batches (dicts with ``tokens``, or token tensors) the run will feed, in order (None: checked
            batch by batch while streaming). Checked against the recorded token digests: their number, each
            batch's tokens, and their order.

    Raises:
        LogitStoreError: a missing or unreadable manifest, another format or version, a missing shard or one of
            another size, or a ``top_k`` / ``vocab_size`` / batch that differs from the store (the message names
            the file, the field, the stored and the expected value).
    """

    def __init__(self, directory: str | os.PathLike, *, top_k: int | None = None, vocab_size: int | None = None,
                 batches=None):
        self.directory = Path(directory)
        path = self.directory / MANIFEST
        try:
            m = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise LogitStoreError(f"teacher logits store {path}: cannot read the manifest ({e})") from e
        if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") != VERSION:
            found = (m.get("format"), m.get("version")) if isinstance(m, dict) else type(m).__name__
            raise LogitStoreError(f"teacher logits store {path}: format/version {found}; expected "
                                  f"({FORMAT!r}, {VERSION})")
        for key in ("top_k", "vocab_size", "values_dtype", "batches", "tokens_sha256", "tokens_shape", "shards"):
            if key not in m:
                raise LogitStoreError(f"teacher logits store {path}: field {key!r} is missing")
        try:  # every shard entry readable, before any of it is used
            m["shards"] = [{"file": str(s["file"]), "first": int(s["first"]), "count": int(s["count"]),
                            "bytes": int(s["bytes"])} for s in m["shards"]]
        except (KeyError, TypeError, ValueError) as e:
            raise LogitStoreError(f"teacher logits store {path}: field 'shards' is damaged ({type(e).__name__}: "
                                  f"{e}); expected a list of {{file, first, count, bytes}}") from e
        for key, want in (("top_k", top_k), ("vocab_size", vocab_size)):
            if want is not None and m[key] != want:
                raise LogitStoreError(f"teacher logits store {path}: field {key!r} is {m[key]}, but the run "
                                      f"expects {want} (a store written for another teacher or setting)")
        if m["values_dtype"] not in VALUE_DTYPES:
            raise LogitStoreError(f"teacher logits store {path}: field 'values_dtype' is {m['values_dtype']!r}; "
                                  f"expected one of {list(VALUE_DTYPES)}")
        if len(m["tokens_sha256"]) != m["batches"] or sum(s["count"] for s in m["shards"]) != m["batches"]:
            raise LogitStoreError(f"teacher logits store {path}: field 'batches' is {m['batches']} but the digests "
                                  f"and shards list {len(m['tokens_sha256'])} and "
                                  f"{sum(s['count'] for s in m['shards'])} (a damaged manifest)")
        for s in m["shards"]:
            f = self.directory / s["file"]
            size = f.stat().st_size if f.is_file() else None
            if size != s["bytes"]:
                raise LogitStoreError(f"teacher logits store {f}: {'missing' if size is None else f'{size} bytes'}; "
                                      f"the manifest's field 'shards' records {s['bytes']} bytes")
        self.manifest = m
        self.top_k, self.vocab_size, self.num_batches = m["top_k"], m["vocab_size"], m["batches"]
        self.values_dtype = VALUE_DTYPES[m["values_dtype"]]
        self._loaded: tuple[int, list] | None = None
        if batches is not None:
            self.check_batches(batches)

    def __len__(self) -> int:
        return self.num_batches

    def check_batches(self, batches) -> None:
        """Refuses ``batches`` (dicts with ``tokens``, or token tensors, in the order the run feeds them) unless they
        are the store's, in its order.

        Raises:
            LogitStoreError: naming the manifest, the batch and what differs (count, tokens, order).
        """
        path = self.directory / MANIFEST
        digests = [token_digest(b["tokens"] if isinstance(b, dict) else b) for b in batches]
        stored = self.manifest["tokens_sha256"]
        if len(digests) != len(stored):
            raise LogitStoreError(f"teacher logits store {path}: field 'batches' is {len(stored)}, but the run "
                                  f"feeds {len(digests)} batches")
        for i, (d, s) in enumerate(zip(digests, stored, strict=True)):
            if d != s:
                where = f"stored as batch {stored.index(d)}: another data order" if d in stored else "another data"
                raise LogitStoreError(f"teacher logits store {path}: field 'tokens_sha256[{i}]': batch {i}'s tokens "
                                      f"differ from the stored ones ({where})")

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, indices)`` of batch ``i``: ``[*tokens.shape, w]`` in the stored dtype and int32 (``w >= k``: the
        logits tied with the k-th largest are there too; shorter rows end in padding, -inf at id -1)."""
        if not 0 <= i < self.num_batches:
            raise IndexError(f"teacher logits store {self.directory}: batch {i} of {self.num_batches}")
        for s in self.manifest["shards"]:
            if s["first"] <= i < s["first"] + s["count"]:
                break
        if self._loaded is None or self._loaded[0] != s["first"]:  # one shard in memory at a time
            f = self.directory / s["file"]
            try:
                records = torch.load(f, map_location="cpu", weights_only=True)
            except Exception as e:
                raise LogitStoreError(f"teacher logits store {f}: cannot be read ({type(e).__name__}: {e})") from e
            if not isinstance(records, list) or len(records) != s["count"]:
                raise LogitStoreError(f"teacher logits store {f}: holds {len(records)} batches, the manifest's "
                                      f"field 'shards' records {s['count']}")
            self._loaded = (s["first"], records)
        r = self._loaded[1][i - s["first"]]
        return r["values"], r["indices"]


class StoredTeacherLogits(nn.Module):
    """Stands for the teacher in :class:`~modelopt_moe.distill.DistillationModel`: each call returns the next stored
    batch's logits (cycling over the store: a second epoch starts again at batch 0), after checking the call's
    tokens against the store.

    The logits are ``[*tokens.shape, vocab_slice]`` in the stored dtype: the stored top-k values at their ids,
    ``-inf`` elsewhere; with the vocabulary split over tensor-parallel ranks, this rank's slice (ids
    ``[first, first + vocab_slice)``). It holds no parameter.

    Args:
        store: the opened store.
        vocab_first: the first vocabulary id of this rank's slice.
        vocab_slice: the ids of this rank's slice (None: the whole vocabulary).
        start_batch: the store's batch the first call reads (a run resumed after ``n`` micro-batches: ``n``).
    """

    def __init__(self, store: TeacherLogitsStore, vocab_first: int = 0, vocab_slice: int | None = None,
                 start_batch: int = 0):
        super().__init__()
        self.store, self.vocab_first = store, vocab_first
        self.vocab_slice = store.vocab_size if vocab_slice is None else vocab_slice
        self.top_k, self.position = store.top_k, start_batch % len(store)

    def forward(self, tokens: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """The stored logits of the next batch (``tokens``: the batch's token ids, the models' first input).

        Raises:
            LogitStoreError: ``tokens`` are not those of the batch the store holds at this position.
        """
        i = self.position
        if token_digest(tokens) != self.store.manifest["tokens_sha256"][i]:
            raise LogitStoreError(f"teacher logits store {self.store.directory / MANIFEST}: field "
                                  f"'tokens_sha256[{i}]': the tokens of the run's batch {i} differ from the stored "
                                  "ones (another data order or data)")
        self.position = (i + 1) % len(self.store)
        values, ids = self.store.batch(i)
        local = ids.to(tokens.device, torch.int64).reshape(-1, ids.shape[-1]) - self.vocab_first
        inside = (local >= 0) & (local < self.vocab_slice)  # the ids of this rank's slice
        rows = torch.arange(local.shape[0], device=tokens.device).unsqueeze(-1).expand_as(local)
        out = torch.full((local.shape[0], self.vocab_slice), float("-inf"), dtype=values.dtype, device=tokens.device)
        out[rows[inside], local[inside]] = values.to(tokens.device).reshape(local.shape)[inside]
        return out.reshape(*tokens.shape, self.vocab_slice)
