"""``python -m vllm_semmoe.cli``: the ``semmoe`` command."""

import sys

from . import main

sys.exit(main())
