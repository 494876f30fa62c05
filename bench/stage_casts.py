"""What letting the database judge each value costs: a staging table of text, cast in the apply.

    .venv/bin/python bench/stage_casts.py --rows 100000 --runs 5

The same batch of ledger rows is COPYed into a staging table whose field
columns are typed (values parsed by COPY, in the executors' sessions) and into
one whose field columns are text (``staging.stage_column_types``: values
parsed by the apply's CASTs, in the driver's batch transaction), and the apply
statement runs on each, rolled back. Rounds alternate in a shuffled order;
medians over ``--runs``. PostgreSQL only, no Spark: the figure is the database
work that moved, not a pipeline's rate (``bench/sink_throughput.py`` gives that).

Writes bench/results/stage_casts.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import time
from pathlib import Path

import psycopg2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import ROOT, drop_schemas, fresh_ledger_schemas, local_stack, machine
from spark_apps.eos_stream.records.parsing import staging_columns, staging_lines
from spark_apps.eos_stream.sink import apply_sql
from spark_apps.eos_stream.sink.staging import copy_from_chunks, create_table, stage_column_types
from spark_apps.ledger.generator import _event
from spark_apps.ledger.spec import LEDGER

META, TARGET = "m_bench_stage_casts", "t_bench_stage_casts"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "stage_casts.json")
    args = parser.parse_args()
    stack = local_stack()
    conn = psycopg2.connect(host=stack["EOS_PG_HOST"], port=stack["EOS_PG_PORT"], dbname=stack["EOS_PG_DB"],
                            user=stack["EOS_PG_USER"], password=stack["EOS_PG_PASSWORD"])
    rng, start = random.Random(1), datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    records = [("bench", i % 4, i, None, _event(rng, i, 200, start)[1]) for i in range(args.rows)]
    data = "".join(staging_lines(LEDGER, records, False)).encode()
    field_types = {f.name: f.pg_type for f in LEDGER.fields}
    layouts = {"text": stage_column_types(LEDGER),
               "typed": [(c, field_types.get(c, t)) for c, t in stage_column_types(LEDGER)]}
    fresh_ledger_schemas(conn, META, TARGET)
    timings: dict[str, dict[str, list[float]]] = {kind: {"copy": [], "apply": []} for kind in layouts}
    for run in range(args.runs):
        for kind in random.Random(run).sample(sorted(layouts), len(layouts)):
            with conn.cursor() as cur:
                stage = create_table(cur, META, f"stage_{kind}", layouts[kind])
                began = time.perf_counter()
                copy_from_chunks(cur, stage, staging_columns(LEDGER), iter([data]))
                timings[kind]["copy"].append(time.perf_counter() - began)
            conn.commit()
            statement = apply_sql.apply_batch_statement(LEDGER, stage=stage, target_schema=TARGET, meta_schema=META,
                                                        skip_applied=True, dedupe=False, upsert_rows=False)
            with conn.cursor() as cur:
                began = time.perf_counter()
                cur.execute(statement, {"pipeline": "bench"})
                cur.fetchone()
                timings[kind]["apply"].append(time.perf_counter() - began)
            conn.rollback()
    drop_schemas(conn, META, TARGET)
    conn.close()
    medians = {kind: {phase: round(statistics.median(values) * 1000, 1) for phase, values in phases.items()}
               for kind, phases in timings.items()}
    result = {"machine": machine(), "rows": args.rows, "runs": args.runs, "medians_ms": medians,
              "runs_ms": {kind: {phase: [round(v * 1000, 1) for v in values] for phase, values in phases.items()}
                          for kind, phases in timings.items()},
              "text_minus_typed_ms": {p: round(medians["text"][p] - medians["typed"][p], 1) for p in ("copy", "apply")}}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"medians_ms": medians, "text_minus_typed_ms": result["text_minus_typed_ms"]}, indent=2))


if __name__ == "__main__":
    main()
