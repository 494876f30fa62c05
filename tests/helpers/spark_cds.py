"""A class-data-sharing archive for the tests' Spark drivers.

A test's driver lives for seconds, and loading, verifying and linking Spark's classes is a
third of its start: on the 2-core Intel VM the first batch came 15 to 16 s after spark-submit
instead of 22 to 25 s (docs/testing.md). The JDK's dynamic AppCDS maps those classes from an
archive instead. One real run of the app writes it at its exit (``-XX:ArchiveClassesAtExit``),
once per JVM, pyspark and JVM options: the file's name carries them, so a change makes a new one.
The JVM checks an archive against its own build and class path and ignores one that does not
match, so a stale or missing archive only costs the time it would have saved; nothing the app
does changes. The classes of ``--jars`` (the Kafka connector) load through Spark's own class
loader and are not archived.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pyspark

from airflow_provider_eos.launchers.spark_options import LOCAL_DRIVER_JAVA_OPTIONS
from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.helpers.locks import file_lock
from tests.streaming import pipeline_config, run_app

# JVM options for every spark-submit the tests start (spark-submit adds SPARK_SUBMIT_OPTS to the
# driver's JVM): the ones the stream operator gives a local master's driver, so that the tests'
# drivers run as users' do and the archive is written by the JVM configuration that reads it.
TEST_SPARK_SUBMIT_OPTS = LOCAL_DRIVER_JAVA_OPTIONS
# A few batches of the ledger: enough to load every class a run's start and its batches use.
_EVENTS = 3000


def _archive_key(jvm_opts: str) -> str:
    """What an archive depends on: the java that spark-submit runs, the Spark build, the options."""
    java = shutil.which("java") or "java"
    version = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60).stderr
    jars = sorted(p.name for p in (Path(pyspark.__file__).parent / "jars").glob("*.jar"))
    digest = hashlib.sha256("\n".join([version, jvm_opts, *jars]).encode()).hexdigest()
    return digest[:16]


def driver_archive_opts(stack: dict[str, str], state_dir: Path, jvm_opts: str) -> str:
    """``-XX:SharedArchiveFile=...`` for drivers started with ``jvm_opts``, dumping the archive
    first by one app run if there is none yet; empty when that run fails (the tests then run
    without it, as slowly as before, and the reason is printed)."""
    folder = state_dir / "spark-cds"
    archive = folder / f"driver-{_archive_key(jvm_opts)}.jsa"
    # One dump at a time on the machine: scripts/test.sh's in the background, or the first
    # xdist worker's; whoever comes next finds the archive.
    with file_lock(state_dir / "spark-cds.lock"):
        if not archive.exists():
            folder.mkdir(parents=True, exist_ok=True)
            for stale in folder.glob("driver-*"):  # older archives, and what an interrupted dump left
                stale.unlink()
            try:
                _dump(stack, folder, archive, jvm_opts)
            except Exception as exc:  # a failed dump must not fail the tests: they run without it
                print(f"spark_cds: no archive: {type(exc).__name__}: {str(exc)[-2000:]}")
                return ""
    return f"-XX:SharedArchiveFile={archive}"


def _dump(stack: dict[str, str], folder: Path, archive: Path, jvm_opts: str) -> None:
    """One app run over a small topic of its own, which writes ``archive`` at its exit."""
    work = folder / f"dump-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    name = f"cds{uuid.uuid4().hex[:8]}"
    partial = folder / f"{archive.name}.{name}.part"
    try:
        ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], f"ledger.{name}", partitions=2)
        produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], _EVENTS, topic=f"ledger.{name}", batch_size=500, seed=3)
        config = pipeline_config(stack, work, name, max_offsets_per_trigger=1000)
        run = run_app(config, work, label="cds-dump", timeout=300,
                      env_extra={"SPARK_SUBMIT_OPTS": f"{jvm_opts} -XX:ArchiveClassesAtExit={partial}"})
        if run.process.returncode != 0 or not partial.exists():
            raise RuntimeError(f"the dump run exited {run.process.returncode}; log tail:\n{run.log()[-2000:]}")
        partial.rename(archive)  # whole, or not at all: a JVM never maps a half-written one
    finally:
        partial.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    """Dumps the archive now (``scripts/test.sh`` runs this beside ruff and mypy, so the tests'
    first spark-submit finds it): ``python -m tests.helpers.spark_cds``. Nothing to do when
    ``SPARK_SUBMIT_OPTS`` is set (the tests then use those options, without the archive)."""
    from demo.env_files import STATE_DIR, read_env_file

    if "SPARK_SUBMIT_OPTS" in os.environ:
        return 0
    stack = read_env_file(STATE_DIR / "stack.env")
    os.environ.update(stack)
    os.environ["PGPASSWORD"] = stack["EOS_PG_PASSWORD"]
    opts = driver_archive_opts(stack, STATE_DIR, TEST_SPARK_SUBMIT_OPTS)
    print(f"spark_cds: {opts or 'no archive'}")
    return 0 if opts else 1


if __name__ == "__main__":
    sys.exit(main())
