"""``modelopt_moe.plugins.quiet_known_warnings()``: a script hides the known harmless third-party warnings and log
notices (whenever their loggers are created, however logging is configured) and sees every other message. In a
fresh interpreter, as a user's script runs it."""

import subprocess
import sys

SCRIPT = """
import logging, warnings
from modelopt_moe.plugins import quiet_known_warnings

quiet_known_warnings()
quiet_known_warnings()  # twice: nothing changes
logging.basicConfig(level=logging.INFO)  # the script configures logging after the call
warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning, stacklevel=1)
warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...", FutureWarning, stacklevel=1)
logging.getLogger("megatron.core.models.gpt.gpt_model").warning("GPTModel IS DEPRECATED. GPTModel is only ...")
logging.getLogger("megatron.core.models.gpt.gpt_model").warning("a notice worth reading")
warnings.warn("a warning worth reading", UserWarning, stacklevel=1)
import sys, modelopt_moe.plugins
print(sorted(m for m in sys.modules if m.split(".")[0] in ("megatron", "transformer_engine", "transformers")))
"""


def test_a_script_hides_the_known_messages_and_sees_the_others():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for hidden in ("Apex is not installed", "all_gather_into_tensor", "GPTModel IS DEPRECATED"):
        assert hidden not in done.stderr, done.stderr
    assert "a notice worth reading" in done.stderr
    assert "a warning worth reading" in done.stderr
    assert done.stdout.strip() == "[]"  # the call imports no framework
