"""``python -m spark_apps.eos_stream.audit``: prints the audit's JSON report (``oracle``).

Exits 1 on any mismatch, 0 when exact, 2 when the read of Kafka timed out."""

from __future__ import annotations

import argparse
import json
import sys

from spark_apps.eos_stream.audit.oracle import DEFAULT_TIMEOUT, audit
from spark_apps.eos_stream.audit.readers import PARALLEL_MIN_RECORDS
from spark_apps.eos_stream.audit.rules import PENDING_POLICIES, AuditTimeout
from spark_apps.eos_stream.kafka.offsets import from_nested
from spark_apps.eos_stream.records.spec import spec_of
from spark_apps.eos_stream.run.config import add_config_arguments, config_from_arguments


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spark_apps.eos_stream.audit",
                                     description="Audit a pipeline's target against Kafka")
    add_config_arguments(parser)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help=f"seconds the read of Kafka may take (default {DEFAULT_TIMEOUT:g})")
    parser.add_argument("--pending", choices=PENDING_POLICIES, default="auto",
                        help="records above the stored offsets: auto (not yet applied while a driver runs "
                        "or --goal is given, missing otherwise), missing, allowed")
    parser.add_argument("--goal", type=json.loads, default=None,
                        help='offsets the stored ones must have reached, {"topic": {"partition": offset}} '
                        "(a replay's lso_at_start)")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes reading Kafka (default: one per core for a read of "
                        f"{PARALLEL_MIN_RECORDS:,} offsets or more, else 1: this process)")
    args = parser.parse_args(argv)
    config = config_from_arguments(args)
    try:
        report = audit(config, spec_of(config), timeout=args.timeout, pending=args.pending,
                       goal=None if args.goal is None else from_nested(args.goal), workers=args.workers)
    except AuditTimeout as exc:
        print(str(exc), file=sys.stderr)
        print(json.dumps({"pipeline": config.pipeline, "ok": False, "error": str(exc),
                          "unfinished": exc.unfinished}, indent=2, sort_keys=True))
        return 2
    print(json.dumps(report, indent=2, sort_keys=True, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
