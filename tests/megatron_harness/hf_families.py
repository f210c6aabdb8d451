"""What the end-to-end tests of a Hugging Face family share: the shipped tiny config, the inputs and logits of a test
rank, the Megatron model built and imported at one TP x EP layout (logits taken, ``format="hf"`` export written), and
the transformers / safetensors side that the tests compare against.

Imports Megatron-Core only inside :func:`import_at_layout`, which runs on the spawned ranks.
"""

import json
from pathlib import Path

import torch

from modelopt_moe.quantization.config import preset_path


def tiny_config(filename: str) -> dict:
    """The shipped tiny config ``configs/<filename>``, without the keys only a checkpoint carries."""
    cfg = json.loads(preset_path(filename).read_text())
    return {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}


def rank_inputs(vocab: int):
    """A test rank's inputs (seeded: every rank draws the same tokens) and its logits function.

    Returns:
        ``(tokens, positions, causal, logits)``: 2 x 16 tokens, their positions, the causal mask, and
        ``logits(model)``, the model's gathered fp32 logits on them without autograd.
    """
    torch.manual_seed(1)
    tokens = torch.randint(0, vocab, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    causal = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)[None, None]

    def logits(m):
        with torch.no_grad():
            return m(tokens, positions, causal, runtime_gather_output=True).float()

    return tokens, positions, causal, logits


def import_at_layout(src, out, tp: int, ep: int, logits, res: dict, **parallel):
    """Initialize TP x EP, build the fp32 Megatron model from ``src``, import it, and record and export it.

    Stores ``logits(model)`` as ``res["logits_tp{tp}_ep{ep}"]`` and exports ``format="hf"`` in bf16 to
    ``out/hf_tp{tp}_ep{ep}`` (at TP 1 with the source's config as template: it must agree). The caller destroys the
    model parallel state when done with the layout.

    Args:
        src: The Hugging Face checkpoint directory.
        out: The directory the export goes under.
        tp: Tensor-parallel size.
        ep: Expert-parallel size.
        logits: The rank's logits function (:func:`rank_inputs`).
        res: The rank's result dict.
        **parallel: More keywords for ``parallel_state.initialize_model_parallel``.

    Returns:
        The model, in eval mode.
    """
    from megatron.core import parallel_state, tensor_parallel

    from modelopt_moe.export import build_megatron_model, export_hf, import_hf

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep, **parallel)
    tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
    model = build_megatron_model(src, params_dtype=torch.float32)
    import_hf(model, src)
    model.eval()
    res[f"logits_tp{tp}_ep{ep}"] = logits(model)
    export_hf(model, Path(out) / f"hf_tp{tp}_ep{ep}", format="hf", dtype=torch.bfloat16, progress=False,
              hf_config=src if tp == 1 else None)
    return model


def hf_logits(path, tokens, **kw) -> torch.Tensor:
    """The fp32 logits transformers gives for the checkpoint at ``path`` (``kw`` go to ``from_pretrained``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``path``."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out
