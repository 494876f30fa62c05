"""The collector's tuning (``spark_apps/eos_stream/collector.py``), in a process of its own: the
thresholds it sets would otherwise stay with the test process."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

_TUNE_TWICE = """
import gc, json
from spark_apps.eos_stream import collector
before = gc.get_threshold()
collector.tune()
frozen = gc.get_freeze_count()
made_later = [[] for _ in range(1000)]
collector.tune()
print(json.dumps({"before": before, "after": gc.get_threshold(), "frozen": frozen,
                  "frozen_again": gc.get_freeze_count() - frozen}))
"""


def test_the_collector_is_tuned_once_per_process_after_what_it_made() -> None:
    out = subprocess.run([sys.executable, "-c", _TUNE_TWICE], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    found = json.loads(out)
    assert found["before"] != list(found["after"])  # Python's defaults, then the stream's
    assert tuple(found["after"]) == (100_000, 50, 1000)
    assert found["frozen"] > 1000  # the modules imported before the first batch
    assert found["frozen_again"] == 0  # a second call (the next task in a Python worker) freezes nothing more
