"""The file spark-submit runs: the Spark engine (``engines/spark.py``).

    spark-submit --jars <spark-sql-kafka...> spark_apps/eos_stream/app.py --config pipeline.json

A file, not a module: spark-submit takes a path, and the provider, the demo and the benchmarks
know a Spark driver by this path in its command line. Exit codes: ``run/entry.py``.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file by spark-submit: make `spark_apps` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from spark_apps.eos_stream.engines.spark import main

if __name__ == "__main__":
    sys.exit(main())
