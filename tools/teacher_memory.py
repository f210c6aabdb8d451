"""Memory of the QAD teacher per GPU: bf16 weights, FP8 weights, or precomputed top-k logits streamed from disk.

The teacher is a Qwen3-30B-A3B-shaped Megatron ``GPTModel`` layer stack (defaults: 2 layers of hidden 2048, 32
attention heads of 128 in 4 KV groups, 128 experts of FFN 768, top-8, SwiGLU, RMSNorm, vocabulary 151,936), on one GPU
(TP = EP = 1), built with Megatron's local layer spec and the project's grouped experts (``TEGroupedMLP``'s layout
without Transformer Engine: FP8 teacher storage refuses TE modules). Variants:

  bf16        the teacher as QAD holds it today: bf16 weights, a forward per micro-batch
  fp8         ``QADRecipe(teacher_fp8="per_channel")``: the weight matrices as FP8 E4M3 codes + per-channel scales,
              dequantized per layer in the forward (router and norms stay bf16)
  stored      ``stored_teacher_logits``: no teacher model on the GPU; each micro-batch's top-``--logits-k`` logits
              (bf16 values, int32 ids) come from disk and are spread to the ``[tokens, vocab]`` tensor the top-k KL
              reads

Columns, per variant: ``resident MiB`` (what the teacher holds between micro-batches: its parameters and buffers),
``+forward MiB`` (``torch.cuda.max_memory_allocated`` over one teacher forward of one micro-batch, minus what was
allocated before it: activations, one layer's dequantized weights, the logits it returns; the stored variant's is
the spread logits), ``peak MiB`` (their sum), the ratio to bf16, and ``disk MiB`` (the stored logits of one
micro-batch). Below the table, the resident bytes extrapolated per layer to ``--full-layers`` (48, the published
model's depth). On CPU (``--tiny``, what the test runs) the forward columns are ``-``: CPU has no allocator peak.

Usage (GPU machine, megatron-core installed; Transformer Engine not needed):
  python3 tools/teacher_memory.py --device cuda [--layers 2] [--seq 4096] [--micro-batch 1] [--logits-k 4096]
  python3 tools/teacher_memory.py --tiny            # CPU, tiny sizes: the numbers mean nothing there
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

TINY = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "experts": 8, "moe_ffn_hidden": 32,
        "topk": 2, "vocab": 512, "seq": 32, "micro_batch": 2, "logits_k": 16}
VARIANTS = ("bf16", "fp8", "stored")
MIB = 2.0 ** 20


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; ``--tiny`` replaces the sizes by :data:`TINY`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the teacher runs (default: cpu)")
    p.add_argument("--tiny", action="store_true", help=f"tiny sizes for a CPU smoke run: {TINY}")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--full-layers", type=int, default=48, help="layers of the whole model, for the extrapolation")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--moe-ffn-hidden", type=int, default=768)
    p.add_argument("--topk", type=int, default=8, help="experts per token")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--logits-k", type=int, default=4096, help="teacher logits kept per token by the stored variant")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    if args.device == "cpu" and torch.cuda.is_available():
        p.error("--device cpu on a machine with CUDA: Megatron places the model on the GPU there; use --device cuda")
    return args


def build_teacher(args, seed: int = 1234):
    """The Qwen3-30B-A3B-shaped stack, bf16, in eval mode (the tests' model builder, as bench_megatron_step.py)."""
    tests = str(Path(__file__).resolve().parents[1] / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import megatron_harness.models as mm

    return mm.build_moe_gpt(
        num_layers=args.layers, hidden=args.hidden, ffn_hidden=args.moe_ffn_hidden, num_experts=args.experts,
        vocab_size=args.vocab, seq_len=args.seq, moe_router_topk=args.topk, params_dtype=torch.bfloat16, seed=seed,
        experts="grouped", num_attention_heads=args.heads, num_query_groups=args.kv_heads, kv_channels=args.head_dim,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        moe_router_load_balancing_type="none",
    ).eval()


def forward_peak(fn) -> tuple[float | None, torch.Tensor]:
    """``fn()``'s output and the MiB it allocated at its peak above what was allocated before (None on CPU)."""
    if not torch.cuda.is_available():
        with torch.no_grad():
            return None, fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        out = fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / MIB, out


def non_layer_bytes(model) -> int:
    """Resident bytes outside the transformer layers (embedding, final norm, output layer)."""
    from modelopt_moe.distill.teacher_fp8 import stored_bytes

    return stored_bytes(model) - sum(stored_bytes(layer) for layer in model.decoder.layers)


def _model_row(teacher, variant: str, inputs, layers: int) -> tuple[dict, torch.Tensor]:
    """One model variant's row, and the logits of its forward."""
    from modelopt_moe.distill.teacher_fp8 import stored_bytes

    resident, other = stored_bytes(teacher), non_layer_bytes(teacher)
    peak, logits = forward_peak(lambda: teacher(*inputs))
    return {"variant": variant, "resident_mib": resident / MIB, "forward_mib": peak,
            "layer_mib": (resident - other) / layers / MIB, "other_mib": other / MIB, "disk_mib": 0.0}, logits


def measure(args) -> list[dict]:
    """The rows of every variant, in :data:`VARIANTS` order (one teacher built, then stored in FP8 in place)."""
    from bench_megatron_step import init_distributed, random_batches

    from modelopt_moe.distill import StoredTeacherLogits, TeacherLogitsStore, TeacherLogitsWriter, store_weights_fp8

    init_distributed(1234)
    device = torch.device(args.device)
    batch = random_batches(args, 1, device, seed=7)[0]
    inputs = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    teacher = build_teacher(args)
    row, logits = _model_row(teacher, "bf16", inputs, args.layers)
    rows, reference = [row], logits.to("cpu", copy=True)
    del logits
    store_weights_fp8(teacher, "per_channel")
    rows.append(_model_row(teacher, "fp8", inputs, args.layers)[0])
    del teacher
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        writer = TeacherLogitsWriter(Path(tmp) / "store", top_k=args.logits_k, values_dtype=torch.bfloat16)
        writer.add(batch["tokens"].cpu(), reference)
        path = writer.commit()
        stored = StoredTeacherLogits(TeacherLogitsStore(path, top_k=args.logits_k, vocab_size=args.vocab))
        disk = sum(f.stat().st_size for f in path.iterdir())
        peak, _ = forward_peak(lambda: stored(*inputs))
    rows.append({"variant": "stored", "resident_mib": 0.0, "forward_mib": peak, "layer_mib": 0.0, "other_mib": 0.0,
                 "disk_mib": disk / MIB})
    for r in rows:
        r["peak_mib"] = None if r["forward_mib"] is None else r["resident_mib"] + r["forward_mib"]
        r["full_model_gib"] = (r["layer_mib"] * args.full_layers + r["other_mib"]) / 1024
    return rows


def _cell(value, fmt="{:,.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def table(args, rows: list[dict]) -> str:
    """The printed table."""
    base = rows[0]
    key = "peak_mib" if base["peak_mib"] is not None else "resident_mib"
    lines = [f"teacher memory per GPU on {args.device}: {args.layers} layers of hidden {args.hidden}, {args.experts} "
             f"experts top-{args.topk} of FFN {args.moe_ffn_hidden}, vocab {args.vocab:,}, micro-batch "
             f"{args.micro_batch} x {args.seq} tokens, stored top-{args.logits_k}",
             f"{'variant':<8} {'resident MiB':>13} {'+forward MiB':>13} {'peak MiB':>10} {'vs bf16':>8} "
             f"{'disk MiB':>9} {'per layer MiB':>14} {f'{args.full_layers} layers GiB':>14}"]
    for r in rows:
        ratio = r[key] / base[key] if r[key] is not None and base[key] else None
        lines.append(f"{r['variant']:<8} {_cell(r['resident_mib']):>13} {_cell(r['forward_mib']):>13} "
                     f"{_cell(r['peak_mib']):>10} {_cell(ratio, '{:.2f}x'):>8} {_cell(r['disk_mib'], '{:,.2f}'):>9} "
                     f"{_cell(r['layer_mib']):>14} {_cell(r['full_model_gib'], '{:,.2f}'):>14}")
    lines.append(f"vs bf16: of {'peak' if key == 'peak_mib' else 'resident'} memory. '{args.full_layers} layers': "
                 "the resident bytes per layer times the layers, plus embedding, final norm and output layer.")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Measures and prints the table (and writes ``--json``)."""
    args = parse_args(argv)
    rows = measure(args)
    print(table(args, rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
