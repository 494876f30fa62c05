"""spark-submit of the eos streaming app (``spark_apps/eos_stream/app.py``) through the
Spark provider's SparkSubmitHook: config in a private temp file, secrets in the
environment only, ``EOS-`` progress lines parsed, the whole process group killed on kill."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_eos.launchers.protocol import KAFKA_OPTIONS_ENV, PASSWORD_ENV, kill_group
from airflow_provider_eos.launchers.result import (
    EXIT_CONFIG,
    EXIT_DATA_LOST,
    EXIT_FAILED,
    EXIT_FENCED,
    EXIT_OK,
    AppRunResult,
    parse_event,
)
from airflow_provider_eos.launchers.spark_options import LOCAL_DRIVER_JAVA_OPTIONS, is_local_master
from airflow_provider_eos.utils import provider_config

# The run's result and events are every launcher's (launchers/result.py); named here too for the
# hook's users. The secrets' environment variables are the launchers' (launchers/protocol.py).
__all__ = ["EXIT_CONFIG", "EXIT_DATA_LOST", "EXIT_FAILED", "EXIT_FENCED", "EXIT_OK", "AppRunResult",
           "EosStreamSubmitHook", "parse_event"]
CONTINUOUS = "continuous"


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
    :param conf: more Spark properties. On a local master ``spark.driver.defaultJavaOptions``
        defaults to ``launchers.spark_options.LOCAL_DRIVER_JAVA_OPTIONS`` (C1 only, serial GC).
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
        if self.local:
            self._conf.setdefault("spark.driver.defaultJavaOptions", LOCAL_DRIVER_JAVA_OPTIONS)
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
        """spark-submits the app and runs it until it exits; never raises for the app's own
        failures. A config of the continuous engine is refused: that engine is no Spark app
        (``launchers.child_process`` runs it)."""
        from spark_apps.eos_stream.run.config import read_deprecated_trigger
        from spark_apps.eos_stream.run.pyspark_pairing import installed_versions, pairing_problem

        if read_deprecated_trigger(config).get("engine") == CONTINUOUS:
            raise AirflowFailException("the continuous engine is not spark-submitted: run it with "
                                       "airflow_provider_eos.launchers.child_process.ChildProcessLauncher")
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
        kill_group(self._submit_sp, self.log, grace_seconds)

    def on_kill(self) -> None:
        self.kill_process_group()
        super().on_kill()  # cluster-side kills (standalone driver, YARN app, k8s pod)
        self.cleanup()

    def cleanup(self) -> None:
        shutil.rmtree(self._workdir, ignore_errors=True)
