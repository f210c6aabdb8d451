"""``python -m modelopt_moe.plugins.cli``: the ``modelopt-moe`` command."""

import sys

from modelopt_moe.plugins.cli import main

sys.exit(main())
