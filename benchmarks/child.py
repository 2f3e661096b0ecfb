"""One contender, one phase, in its own process: ``python -m benchmarks.child`` (config on stdin).

The parent writes the run's config as JSON on stdin (so a DSN's password never
shows in ``ps``); the child imports only its own contender's module, runs it,
and writes its measurements as JSON to ``config["result_file"]``. The parent
measures the child's peak RSS and CPU time from outside (``wait4``).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from .meter import Meter
from .noise import Noise


def main() -> int:
    config: dict[str, Any] = json.load(sys.stdin)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    module_name, _, function = config["entry"].partition(":")
    run = getattr(importlib.import_module(module_name), function)
    # The run's CPU is read as a drain starts and ends (about 1 ms each): the latency phase has no use for it.
    cpu = (Noise(config["service_pids"], parent=config["parent_pid"]).run_cpu_s
           if "parent_pid" in config and config["phase"] == "throughput" else None)
    meter = Meter(int(config["messages"]), latency=config["phase"] == "latency", run_cpu=cpu)
    run(config, meter)
    result = meter.result(float(config.get("warmup_s", 0.0)))
    path = Path(config["result_file"])
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)  # the parent never reads half a file
    return 0


if __name__ == "__main__":
    sys.exit(main())
