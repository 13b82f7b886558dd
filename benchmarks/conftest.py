import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from shared_fixtures import dev_trace, dev_trace_path, solve_cache, tp_seed0  # noqa: E402,F401
