"""Test support: run the streaming app under spark-submit as a real child process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg2

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "spark_apps" / "eos_stream" / "app.py"
SPARK_SUBMIT = Path(sys.executable).with_name("spark-submit")


def pipeline_config(stack: dict[str, str], tmp_path: Path, name: str, **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "pipeline": name,
        "topics": [f"ledger.{name}"],
        "kafka_bootstrap": stack["EOS_KAFKA_BOOTSTRAP"],
        "spec": "spark_apps.ledger.spec:LEDGER",
        "delivery": "exactly_once",
        "trigger": "availableNow",
        "max_offsets_per_trigger": 5000,
        "checkpoint_dir": str(tmp_path / "checkpoints"),
        "target_schema": f"t_{name}",
        "meta_schema": f"m_{name}",
        "create_targets": True,
        "postgres": {"host": stack["EOS_PG_HOST"], "port": int(stack["EOS_PG_PORT"]),
                     "dbname": stack["EOS_PG_DB"], "user": stack["EOS_PG_USER"]},
    }
    config.update(overrides)
    return config


def definition_of(config: dict[str, Any], **sections: Any) -> dict[str, Any]:
    """The pipeline definition (airflow_provider_eos.utils.pipeline_definition), as a dict, of an
    app ``config`` made by :func:`pipeline_config`, with ``sections`` (stream, health, snapshot...)
    merged over what the config implies. Kafka and the database come from the connections."""
    stream = {key: config[key] for key in ("trigger", "trigger_interval", "max_offsets_per_trigger",
                                           "max_batch_attempts", "create_targets") if key in config}
    definition: dict[str, Any] = {
        "name": config["pipeline"],
        "topics": list(config["topics"]),
        "spec": config["spec"],
        "delivery": config["delivery"],
        "target_schema": config["target_schema"],
        "meta_schema": config["meta_schema"],
        "checkpoint_dir": config["checkpoint_dir"],
        "stream": {**stream, **sections.pop("stream", {})},
        **sections,
    }
    return definition


def write_definition(config: dict[str, Any], directory: Path, **sections: dict[str, Any]) -> Path:
    """``<directory>/<pipeline>.yaml``: :func:`definition_of` ``config`` and ``sections``."""
    definition = definition_of(config, **sections)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{config['pipeline']}.yaml"
    path.write_text(json.dumps(definition, indent=2))  # JSON is YAML
    return path


@dataclass
class AppRun:
    process: subprocess.Popen
    log_path: Path
    started: float = field(default_factory=time.monotonic)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL the whole driver: spark-submit's JVM and the Python app."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self, kind: str) -> list[dict[str, Any]]:
        prefix = f"EOS-{kind.upper()} "
        decoder = json.JSONDecoder()  # raw_decode: a JVM line may follow on the same line
        return [decoder.raw_decode(line[len(prefix):])[0] for line in self.log().splitlines()
                if line.startswith(prefix)]


def spark_submit(master: str, jars: str, conf: dict[str, str] | None = None) -> list[str]:
    """spark-submit with the settings every app run here has (a benchmark's Spark peer too),
    then ``conf``'s properties."""
    more = [arg for key, value in (conf or {}).items() for arg in ("--conf", f"{key}={value}")]
    return [str(SPARK_SUBMIT), "--master", master, "--jars", jars,
            "--conf", "spark.ui.enabled=false",
            "--conf", "spark.ui.showConsoleProgress=false",
            "--conf", "spark.driver.host=127.0.0.1",
            "--conf", "spark.driver.bindAddress=127.0.0.1",
            "--conf", "spark.sql.shuffle.partitions=2",
            "--driver-memory", "1g", *more]  # last: a property given twice takes its last value


def start_app(config: dict[str, Any], tmp_path: Path, env_extra: dict[str, str] | None = None,
              label: str = "run", root: Path = ROOT, master: str = "local[2]",
              spark_conf: dict[str, str] | None = None) -> AppRun:
    """Starts the app of the checkout at ``root`` (another one: a benchmark's baseline build),
    with ``spark_conf``'s Spark properties."""
    config_path = tmp_path / f"{config['pipeline']}.json"
    config_path.write_text(json.dumps(config))
    log_path = tmp_path / f"{label}-{time.monotonic_ns()}.log"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           **(env_extra or {})}
    command = [*spark_submit(master, os.environ["EOS_SPARK_JARS"], spark_conf),
               str(root / APP.relative_to(ROOT)), "--config", str(config_path)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root,
                                   start_new_session=True)
    return AppRun(process, log_path)


def start_continuous(config: dict[str, Any], tmp_path: Path, env_extra: dict[str, str] | None = None,
                     label: str = "continuous", root: Path = ROOT) -> AppRun:
    """Starts the continuous engine (``spark_apps.eos_stream.run.continuous``) of the checkout at
    ``root`` on ``config`` (its trigger set to ``continuous``), in a process group of its own, as
    the provider's hook does; its output goes to the run's log."""
    config = {**config, "trigger": "continuous"}
    config_path = tmp_path / f"{config['pipeline']}-{label}.json"
    config_path.write_text(json.dumps(config))
    log_path = tmp_path / f"{label}-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "spark_apps.eos_stream.run.continuous", "--config",
                                    str(config_path)], stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env_extra or {})}, cwd=root, start_new_session=True)
    return AppRun(process, log_path)


def run_app(config: dict[str, Any], tmp_path: Path, timeout: float = 300, **kwargs: Any) -> AppRun:
    run = start_app(config, tmp_path, **kwargs)
    try:
        run.wait(timeout)
    except subprocess.TimeoutExpired:
        run.kill()
        raise AssertionError(f"app did not finish in {timeout}s; log tail:\n{run.log()[-4000:]}") from None
    return run


def run_direct_replay(config: dict[str, Any], tmp_path: Path, env_extra: dict[str, str] | None = None,
                      label: str = "replay", timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Runs the Spark-less replay (``spark_apps.eos_stream.run.direct_replay``) of ``config`` to Kafka's
    last stable offsets: the app's claim and sink without a JVM, for a test that needs a pipeline's
    state but not Spark. In its own process group (a fault point kills the whole group).

    :param config: the app config (:func:`pipeline_config`).
    :param tmp_path: where its config file goes.
    :param env_extra: added to this process's environment.
    :param label: names the config file.
    :param timeout: seconds before ``subprocess.TimeoutExpired``.
    :return: the finished process, its stdout and stderr captured as text.
    """
    path = tmp_path / f"{config['pipeline']}-{label}.json"
    path.write_text(json.dumps(config))
    return subprocess.run([sys.executable, "-m", "spark_apps.eos_stream.run.direct_replay", "--config", str(path)],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env_extra or {})},
                          timeout=timeout, start_new_session=True)


def pg_connect(stack: dict[str, str]):
    conn = psycopg2.connect(host=stack["EOS_PG_HOST"], port=stack["EOS_PG_PORT"], dbname=stack["EOS_PG_DB"],
                            user=stack["EOS_PG_USER"], password=stack["EOS_PG_PASSWORD"])
    conn.autocommit = True
    return conn


def ledger_rows(stack: dict[str, str], schema: str) -> int:
    """Rows in ``<schema>.ledger_events`` (0 while the table does not exist yet)."""
    from psycopg2 import sql

    conn = pg_connect(stack)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT to_regclass(%s)", (sql.SQL("{}.ledger_events").format(
                sql.Identifier(schema)).as_string(cur),))
            if cur.fetchone() == (None,):
                return 0
            cur.execute(sql.SQL("SELECT count(*) FROM {}.ledger_events").format(sql.Identifier(schema)))
            row = cur.fetchone()
            return int(row[0]) if row else 0
    finally:
        conn.close()


def dead_letter_count(conn, config: dict[str, Any]) -> int:
    """Dead letters the pipeline of ``config`` has quarantined."""
    from psycopg2 import sql

    from spark_apps.eos_stream.state import meta_tables

    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT count(*) FROM {} WHERE pipeline = %s").format(
            meta_tables.table(config["meta_schema"], meta_tables.DEAD_LETTERS)), (config["pipeline"],))
        (count,) = cur.fetchone()
    return int(count)


def ledger_order(stack: dict[str, str], schema: str) -> dict[str, int]:
    """Order in ``<schema>.ledger_events``, as docs/ordering.md states it: each account's
    events, taken in Kafka order (partition, offset), have strictly increasing ``seq``
    (the generator numbers committed events in production order).

    :return: ``accounts``; ``split_accounts``, accounts whose events span partitions
        (0 on a topic keyed by account); ``out_of_order_accounts``, accounts with an
        event whose seq is not above its predecessor's (a duplicate counts: it repeats one).
    """
    from psycopg2 import sql

    conn = pg_connect(stack)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL(
                "SELECT count(DISTINCT account_id),"
                " count(DISTINCT account_id) FILTER (WHERE previous IS NOT NULL AND seq <= previous),"
                " (SELECT count(*) FROM (SELECT 1 FROM {t} GROUP BY account_id"
                "  HAVING count(DISTINCT kafka_partition) > 1) split)"
                " FROM (SELECT account_id, seq, lag(seq) OVER (PARTITION BY account_id"
                "       ORDER BY kafka_partition, kafka_offset) AS previous FROM {t}) ordered"
            ).format(t=sql.Identifier(schema, "ledger_events")))
            accounts, out_of_order, split = cur.fetchone()
            return {"accounts": accounts, "split_accounts": split, "out_of_order_accounts": out_of_order}
    finally:
        conn.close()


def audit(config: dict[str, Any], tmp_path: Path, env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    config_path = tmp_path / f"{config['pipeline']}-audit.json"
    config_path.write_text(json.dumps(config))
    result = subprocess.run([sys.executable, "-m", "spark_apps.eos_stream.audit", "--config", str(config_path)],
                            capture_output=True, text=True, cwd=ROOT, timeout=600,
                            env={**os.environ, **(env_extra or {})})
    report = json.loads(result.stdout)
    report["exit_code"] = result.returncode
    return report
