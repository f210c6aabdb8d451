"""tools/qat_recovery.py on one GPU with Transformer Engine grouped experts (``TEGroupedMLP``): a short recovery run
(NVFP4 experts) in which QAD keeps the student far closer to the teacher than plain QAT. Prints the recovery table."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("transformer_engine.pytorch")

from limits import seconds  # noqa: E402
from qat_recovery import RecoveryConfig, format_report, run_recovery  # noqa: E402

from modelopt_moe.launch import spawn  # noqa: E402

EXPERTS = 8


def _recovery(rank, world_size):
    return run_recovery(RecoveryConfig(tp=1, ep=1, experts="te", num_layers=2, hidden=128, ffn_hidden=256,
                                       num_experts=EXPERTS, pretrain_steps=100, steps=20, lr=3e-4, eval_batches=8))


def test_short_qad_recovery_on_te_grouped_experts():
    result = spawn(_recovery, 1, timeout=seconds(900), backend="nccl")[0]
    print(format_report(result))
    qat, qad = result["nvfp4/static/qat"], result["nvfp4/static/qad"]
    assert qad["kl"] < qat["kl"]
