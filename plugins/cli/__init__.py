"""The ``modelopt-moe`` command.

    modelopt-moe demo [flags]      the whole pipeline on a small MoE model, with a report (the default command)
    modelopt-moe export [flags]    a distributed checkpoint -> a servable Hugging Face checkpoint
    modelopt-moe report [flags]    render a run's report again from its run.json
    modelopt-moe qat [flags]       QAT / QAD of your own Megatron model (a model provider and a YAML config)
    modelopt-moe check <dir>       an exported checkpoint against the serving engines' loaders (no GPU)

Every command runs its ranks on this machine (one process per visible GPU, or CPU processes with gloo: the layout is
chosen to fit the machine, ``modelopt_moe.plugins.cli.layout``) or, started by ``torchrun`` or SLURM's ``srun``, in
the launcher's processes (``modelopt_moe.plugins.cli.ranks``). SIGTERM or Ctrl-C stops every rank within seconds
and exits with 128 + the signal (``qat`` names its last complete checkpoint). ``modelopt-moe <command> --help`` for
its flags.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable

from modelopt_moe.interrupt import Interrupted, not_ignored, stop_on_signals

__all__ = ["main", "COMMANDS"]

COMMANDS = {
    "demo": "modelopt_moe.plugins.cli.demo",
    "export": "modelopt_moe.plugins.cli.export",
    "report": "modelopt_moe.plugins.cli.report",
    "qat": "modelopt_moe.plugins.cli.qat",
    "check": "modelopt_moe.plugins.cli.check",
}


def _stopped_by_signals(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """``main`` run with SIGTERM and Ctrl-C turned into :class:`~modelopt_moe.interrupt.Interrupted` (every rank's
    cleanup runs; commands that know more, like qat's checkpoints, say it themselves) and into the exit code 128 +
    the signal."""

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        with stop_on_signals(not_ignored(), exit_after=True):  # an ignored Ctrl-C (`cmd &`) stays ignored
            try:
                return main(argv)
            except Interrupted as e:
                if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":  # once under a launcher
                    print(f"modelopt-moe: {e}", file=sys.stderr, flush=True)
                return e.exit_code

    return run


@_stopped_by_signals
def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit code. Flags without a command (``modelopt-moe --steps 5``) run
    ``demo``; an unknown command is an error that names the commands.

    Each command parses its flags before it imports torch or Megatron, so ``--help`` and usage errors answer at
    once (argparse exits with code 2 on a usage error). SIGTERM or Ctrl-C stops every rank within seconds (the
    command says where, e.g. ``qat`` names its last complete checkpoint) and the exit code is 128 + the signal: 143
    for SIGTERM, 130 for SIGINT."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        print(f"usage: modelopt-moe {{{','.join(COMMANDS)}}} [flags]\nmodelopt-moe: error: unknown command "
              f"{argv[0]!r}; the commands are {', '.join(COMMANDS)} (modelopt-moe --help)", file=sys.stderr)
        return 2
    command, rest = (argv[0], argv[1:]) if argv and argv[0] in COMMANDS else ("demo", argv)
    from ..known_warnings import quiet_known_warnings

    quiet_known_warnings()  # this process's own imports (the command's ranks hide them in theirs)
    return importlib.import_module(COMMANDS[command]).main(rest)
