"""spark-submit of the eos streaming app (``spark_apps/eos_stream/app.py``) through the
Spark provider's SparkSubmitHook: config in a private temp file, secrets in the
environment only, ``EOS-`` progress lines parsed, the whole process group killed on kill."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_eos.utils import provider_config
from spark_apps.eos_stream.kafka.lost_data import DATA_LOST_KIND, EXIT_DATA_LOST

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2
# The app's exit when the database fenced it (``spark_apps.eos_stream.state.fencing.EXIT_FENCED``; not
# imported: this module must load without the app's psycopg2-based modules on the import path).
EXIT_FENCED = 3
# The exit of a run that found a stored offset Kafka no longer holds (retention deleted the
# records, or the topic was recreated): no restart can succeed. The app reports it with this
# exit, or with an ``EOS-ERROR`` line of kind ``data_lost`` (its message names each partition,
# the stored offset and the log's start): ``EXIT_DATA_LOST`` and ``DATA_LOST_KIND``, imported above
# from the app's module that defines them (it needs nothing but the standard library).
EVENT_PREFIX = "EOS-"
_JSON = json.JSONDecoder()
PASSWORD_ENV = "EOS_PG_PASSWORD"
# The engine that runs without Spark instead of spark-submit, and its module.
CONTINUOUS = "continuous"
CONTINUOUS_MODULE = "spark_apps.eos_stream.run.continuous"
KAFKA_OPTIONS_ENV = "EOS_KAFKA_OPTIONS_JSON"


def spark_apps_dir() -> Path:
    """Directory of the ``spark_apps`` package (found without importing pyspark)."""
    spec = importlib.util.find_spec("spark_apps")
    if spec is None or not spec.submodule_search_locations:
        raise AirflowException("the spark_apps package (shipped with airflow-provider-eos) is not importable")
    return Path(next(iter(spec.submodule_search_locations)))


def app_path() -> str:
    return str(spark_apps_dir() / "eos_stream" / "app.py")


def spec_package_files(spec: str | None) -> list[tuple[Path, str]]:
    """The files of the team's own spec package, as ``(file, name in the zip)``, so that executors
    on other hosts import the spec the driver imports.

    ``my_company.specs.payments:PAYMENTS`` ships the whole top-level package ``my_company`` (the spec
    may import its siblings), from wherever this interpreter finds it: the DAGs folder, a
    ``PYTHONPATH`` entry or an installed distribution. Nothing is shipped for the project's own
    specs (``spark_apps`` travels anyway) or for a package this worker cannot import: that one
    must be installed on the cluster (docs/deployment.md says how), and the driver's import
    says so if it is not.
    """
    if not spec:
        return []
    top = spec.partition(":")[0].split(".")[0]
    if top == "spark_apps":
        return []
    found = importlib.util.find_spec(top)
    if found is None:
        return []
    if found.submodule_search_locations:  # a package, or a namespace package's portions
        files = []
        for location in found.submodule_search_locations:
            root = Path(location)
            files += [(f, str(Path(top) / f.relative_to(root))) for f in sorted(root.rglob("*"))
                      if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc"]
        return files
    if found.origin and found.origin.endswith(".py"):
        return [(Path(found.origin), f"{top}.py")]
    return []  # a compiled module: it cannot travel in a zip of sources


def build_spark_apps_zip(target_dir: str | Path, spec: str | None = None) -> str:
    """Zips the ``spark_apps`` package, and the team's spec package (:func:`spec_package_files`),
    for ``--py-files`` (executors on other hosts import both)."""
    root = spark_apps_dir()
    path = Path(target_dir) / "spark_apps.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for file in sorted(root.rglob("*.py")):
            if "__pycache__" not in file.parts:
                archive.write(file, str(Path("spark_apps") / file.relative_to(root)))
        for file, name in spec_package_files(spec):
            archive.write(file, name)
    return str(path)


def parse_event(line: str) -> tuple[str, dict[str, Any]] | None:
    """``EOS-BATCH {...}`` -> ("batch", {...}); None for any other line.

    Anything after the JSON value is ignored: another process writing to the
    same pipe (the driver's JVM logs on stderr) can glue its output to the line."""
    if not line.startswith(EVENT_PREFIX):
        return None
    kind, _, payload = line[len(EVENT_PREFIX):].partition(" ")
    try:
        data = _JSON.raw_decode(payload.lstrip())[0] if payload.strip() else {}
    except json.JSONDecodeError:
        return None
    return kind.lower(), data if isinstance(data, dict) else {"value": data}


@dataclass
class AppRunResult:
    """How one spark-submit of the app ended.

    :param returncode: spark-submit's exit status (negative: killed by that signal).
    :param events: parsed ``EOS-`` lines, in order, as (kind, payload).
    """

    returncode: int
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    duration_s: float = 0.0
    log_tail: str = ""

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [data for k, data in self.events if k == kind]

    @property
    def ok(self) -> bool:
        """The run finished, or stopped on request or at its time."""
        return self.returncode == EXIT_OK

    @property
    def last_error(self) -> dict[str, Any] | None:
        errors = self.of("error")
        return errors[-1] if errors else None

    @property
    def config_error(self) -> bool:
        error = self.last_error
        return self.returncode == EXIT_CONFIG or bool(error and error.get("kind") == "config")

    @property
    def fenced(self) -> bool:
        """The database took the target away from this driver (a newer driver, a restore, a
        fence): it wrote nothing after that, and a restart must begin from the stored offsets."""
        error = self.last_error
        return self.returncode == EXIT_FENCED or bool(
            self.returncode != EXIT_OK and error and error.get("kind") == "fenced")

    @property
    def data_lost(self) -> bool:
        """The run found a stored offset that Kafka no longer holds: a retry would fail the same way."""
        error = self.last_error
        return self.returncode == EXIT_DATA_LOST or bool(
            self.returncode != EXIT_OK and error and error.get("kind") == DATA_LOST_KIND)

    def reason(self) -> str:
        """One line: why this run ended."""
        if self.returncode == EXIT_OK:
            stopped = self.of("stopped")
            return f"stopped ({stopped[-1].get('reason')})" if stopped else "finished"
        error = self.last_error
        if self.fenced:
            detail = error.get("message") if error and error.get("kind") == "fenced" else "no EOS-ERROR line"
            return f"fenced (exit {self.returncode}): {detail}"
        if self.data_lost and not error:
            return f"data lost (exit {self.returncode}): no EOS-ERROR line"
        if error:
            return f"exit {self.returncode}: {error.get('kind')}: {error.get('message')}"
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"killed by {name} (no EOS-ERROR line)"
        tail = self.log_tail.strip().splitlines()[-1:] if self.log_tail else []
        return f"exit {self.returncode} without an EOS-ERROR line" + (f"; last output: {tail[0]}" if tail else "")


def is_local_master(master: str) -> bool:
    return master == "local" or master.startswith("local[") or master.startswith("local-cluster")


class EosStreamSubmitHook(SparkSubmitHook):
    """
    Submits ``spark_apps/eos_stream/app.py`` with one pipeline config.

    The config is written to a private temporary JSON file passed as ``--config``. The
    database password and Kafka client secrets go only into the environment of the
    spark-submit process (``EOS_PG_PASSWORD``, ``EOS_KAFKA_OPTIONS_JSON``), never on the
    command line. For YARN and Kubernetes masters (whose driver env the parent hook would
    put on the command line as ``--conf``) they go into the process environment (client
    mode) and a private ``--properties-file`` (cluster mode) instead.

    :param conn_id: Spark connection, defaults to "spark_default" (host = master, e.g. ``local[*]``).
    :param jars: comma-separated jars (the Spark Kafka connector); default: ``[eos] spark_jars``.
    :param postgres_password: the app's database password (from the postgres connection).
    :param kafka_options: extra Kafka client options for the app (may hold secrets).
    :param driver_host: ``spark.driver.host``; default 127.0.0.1 for local masters only.
    :param driver_bind_address: ``spark.driver.bindAddress``; default 127.0.0.1 for local masters only.
    :param py_files: ``--py-files``; default: a zip of ``spark_apps`` and of the config's spec
        package (:func:`spec_package_files`), built at submit time for non-local masters.
    :param conf: more Spark properties.
    :param kwargs: passed to :class:`SparkSubmitHook` (driver_memory, name, deploy_mode, ...).
    """

    def __init__(
        self,
        *,
        conn_id: str = "spark_default",
        jars: str | None = None,
        postgres_password: str | None = None,
        kafka_options: dict[str, str] | None = None,
        driver_host: str | None = None,
        driver_bind_address: str | None = None,
        py_files: str | None = None,
        conf: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self._secret_env: dict[str, str] = {}
        if postgres_password:
            self._secret_env[PASSWORD_ENV] = postgres_password
        if kafka_options:
            self._secret_env[KAFKA_OPTIONS_ENV] = json.dumps(kafka_options)
        self._workdir = tempfile.mkdtemp(prefix="eos-submit-")
        os.chmod(self._workdir, stat.S_IRWXU)
        super().__init__(
            conn_id=conn_id,
            jars=jars if jars is not None else provider_config.spark_jars(),
            py_files=py_files,
            conf=dict(conf or {}),
            **kwargs,
        )
        master = self._connection["master"]
        self.local = is_local_master(master)
        # The driver's UI is on (Spark's default) on a port the OS picks: two pipelines' drivers on
        # one worker never compete for 4040. Its URL comes back as the app's EOS-UI line.
        self._conf.setdefault("spark.ui.port", "0")
        # The console progress bar writes \r-lines into the driver log, between EOS- lines.
        self._conf.setdefault("spark.ui.showConsoleProgress", "false")
        host = driver_host or ("127.0.0.1" if self.local else None)
        bind = driver_bind_address or ("127.0.0.1" if self.local else None)
        if host:
            self._conf.setdefault("spark.driver.host", host)
        if bind:
            self._conf.setdefault("spark.driver.bindAddress", bind)
        # Built per config (write_config): the zip carries the config's spec package too.
        self._ships_apps = not self.local and not self._py_files
        self._popen_env: dict[str, str] = {}
        env = self._submit_env(bind)
        if self._is_yarn or self._is_kubernetes:
            # The parent hook would turn env_vars into --conf ...Env.X=value on the command line.
            self._popen_env = env
            if self._connection["deploy_mode"] == "cluster" and self._secret_env:
                self._properties_file = self._write_secret_properties()
        else:
            self._env_vars = env
        self.events: list[tuple[str, dict[str, Any]]] = []
        # Called with each EOS- event as it arrives (the supervisor logs what it means at once).
        self.on_event: Callable[[str, dict[str, Any]], None] | None = None
        self.config_path: str | None = None

    def _submit_env(self, bind: str | None) -> dict[str, str]:
        """The spark-submit process's own environment: the secrets, and for a local master the
        UI's address and this interpreter for the driver and its Python workers."""
        env: dict[str, str] = dict(self._secret_env)
        if self.local and bind:
            # The UI binds to SPARK_LOCAL_IP, not to spark.driver.bindAddress (else 0.0.0.0).
            env.setdefault("SPARK_LOCAL_IP", os.environ.get("SPARK_LOCAL_IP", bind))
        if self.local:
            # The driver and the Python workers run here: use this interpreter (it has pyspark).
            env.setdefault("PYSPARK_PYTHON", os.environ.get("PYSPARK_PYTHON", sys.executable))
            env.setdefault("PYSPARK_DRIVER_PYTHON", os.environ.get("PYSPARK_DRIVER_PYTHON", sys.executable))
        binary = self._connection["spark_binary"]
        if shutil.which(binary) is None and (Path(sys.executable).parent / binary).exists():
            env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return env

    def _write_secret_properties(self) -> str:
        prefix = "spark.yarn.appMasterEnv." if self._is_yarn else "spark.kubernetes.driverEnv."
        path = Path(self._workdir) / "secrets.properties"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            for key, value in self._secret_env.items():
                escaped = value.replace("\\", "\\\\").replace("\n", "\\n")
                handle.write(f"{prefix}{key}={escaped}\n")
        return str(path)

    # ------------------------------------------------------------------ command
    def write_config(self, config: dict[str, Any]) -> str:
        if "password" in (config.get("postgres") or {}):
            raise AirflowException("the pipeline config must not hold the database password")
        path = Path(self._workdir) / "pipeline.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(config, handle, indent=2, sort_keys=True)
        self.config_path = str(path)
        if self._ships_apps:
            self._py_files = build_spark_apps_zip(self._workdir, config.get("spec"))
        return self.config_path

    def build_command(self, config: dict[str, Any]) -> list[str]:
        """The spark-submit command line for ``config`` (it holds no secret)."""
        self._application_args = ["--config", self.write_config(config)]
        return self._build_spark_submit_command(app_path())

    def run_app(self, config: dict[str, Any]) -> AppRunResult:
        """Runs the app until it exits; never raises for the app's own failures. A config whose
        engine is ``continuous`` runs the Spark-less engine instead (:meth:`run_continuous`)."""
        from spark_apps.eos_stream.run.config import read_deprecated_trigger
        from spark_apps.eos_stream.run.pyspark_pairing import installed_versions, pairing_problem

        config = read_deprecated_trigger(config)  # a config of before ``engine`` runs as it did
        if config.get("engine") == CONTINUOUS:
            return self.run_continuous(config)

        # spark-submit comes from this environment's pyspark: refuse a mix of two Sparks before it starts.
        problem = pairing_problem(installed_versions())
        if problem:
            raise AirflowFailException(f"cannot spark-submit the app: {problem}")
        self.events = []
        self._application_args = ["--config", self.write_config(config)]
        started = time.monotonic()
        kwargs: dict[str, Any] = {"start_new_session": True}  # its own process group: on_kill ends it all
        if self._popen_env:
            kwargs["env"] = {**os.environ, **self._popen_env}
        try:
            self.submit(app_path(), **kwargs)
        except AirflowException:
            if self._submit_sp is None or self._submit_sp.returncode is None:
                raise
        returncode = self._submit_sp.returncode if self._submit_sp is not None else EXIT_FAILED
        return AppRunResult(
            returncode=int(returncode),
            events=list(self.events),
            duration_s=round(time.monotonic() - started, 2),
            log_tail="\n".join(list(self._last_submit_log_lines)[-5:]),
        )

    def run_continuous(self, config: dict[str, Any]) -> AppRunResult:
        """Runs the continuous engine (``spark_apps.eos_stream.run.continuous``) in this worker, as
        a child in a process group of its own (so :meth:`kill_process_group` ends it as it ends a
        spark-submit), with the secrets in its environment only; its ``EOS-`` lines are read as
        the app's. Never raises for the engine's own failures."""
        self.events = []
        command = [sys.executable, "-m", CONTINUOUS_MODULE, "--config", self.write_config(config)]
        env = {**os.environ, **self._secret_env}
        started = time.monotonic()
        tail: list[str] = []
        self._submit_sp = process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            bufsize=-1, universal_newlines=True, errors="replace")
        assert process.stdout is not None
        self.log.info("Started the continuous engine (pid %s): %s", process.pid, " ".join(command))
        for raw in iter(process.stdout.readline, ""):
            line = raw.rstrip("\n")
            tail = [*tail[-4:], line]
            self._on_line(line)
        returncode = process.wait()
        return AppRunResult(returncode=int(returncode), events=list(self.events),
                            duration_s=round(time.monotonic() - started, 2), log_tail="\n".join(tail))

    def _on_line(self, line: str) -> None:
        """One output line of the engine: an ``EOS-`` event is recorded and passed on; a batch's is
        not logged (one per cycle, tens a second), every other line is."""
        event = parse_event(line.strip())
        if event is not None:
            self._record(event)
            if self.on_event is not None:
                try:
                    self.on_event(*event)
                except Exception:  # a logging callback must never stop the log reader
                    self.log.exception("on_event callback failed for %s", event[0])
            if event[0] == "batch":
                return
        self.log.info("%s", line)

    def _record(self, event: tuple[str, dict[str, Any]]) -> None:
        """Keeps ``event``; a batch's is folded into the previous batch's (its counts summed, its
        end offsets kept, ``folded_batches`` counting them), so a run of weeks at tens of cycles a
        second holds one batch event, not millions."""
        kind, data = event
        last = self.events[-1] if self.events else None
        if kind != "batch" or last is None or last[0] != "batch":
            self.events.append((kind, {**data, "folded_batches": 1} if kind == "batch" else data))
            return
        folded = last[1]
        self.events[-1] = (kind, {**data, "folded_batches": int(folded.get("folded_batches", 1)) + 1,
                                  **{key: int(folded.get(key) or 0) + int(data.get(key) or 0)
                                     for key in ("applied", "dead_lettered")}})

    def _process_spark_submit_log(self, itr: Any) -> None:
        def tee() -> Any:
            for raw in itr:
                event = parse_event(raw.strip())
                if event is not None:
                    self.events.append(event)
                    if self.on_event is not None:
                        try:
                            self.on_event(*event)
                        except Exception:  # a logging callback must never stop the log reader
                            self.log.exception("on_event callback failed for %s", event[0])
                yield raw

        super()._process_spark_submit_log(tee())

    # ------------------------------------------------------------------ kill
    @property
    def pid(self) -> int | None:
        return self._submit_sp.pid if self._submit_sp is not None else None

    def kill_process_group(self, grace_seconds: float = 5.0) -> None:
        """SIGTERM the spark-submit process group (JVM, Python driver, Python workers), then
        SIGKILL whatever is left after ``grace_seconds`` -- including descendants that left the group."""
        process = self._submit_sp
        if process is None or process.poll() is not None:
            return
        try:
            descendants = psutil.Process(process.pid).children(recursive=True)
        except psutil.Error:
            descendants = []
        self.log.info("Stopping spark-submit process group %s (%d descendants)", process.pid, len(descendants))
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for child in descendants:
            try:
                child.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(descendants, timeout=10)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.log.warning("spark-submit %s did not exit after SIGKILL", process.pid)

    def on_kill(self) -> None:
        self.kill_process_group()
        super().on_kill()  # cluster-side kills (standalone driver, YARN app, k8s pod)
        self.cleanup()

    def cleanup(self) -> None:
        shutil.rmtree(self._workdir, ignore_errors=True)
