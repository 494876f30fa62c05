"""The main job end to end: Airflow's real api-server, scheduler, dag-processor
and triggerer, driven through the REST API (not dag.test()). Three pipelines run
at once: the ledger goes through a crash, a hanging transaction and a recovery,
while the orders pipeline streams undisturbed, and a mirror of an application's
tables (Debezium on Kafka Connect) streams through a SIGKILL of the Connect
worker and one of its driver.

It runs on the local Spark standalone cluster (``demo.story --spark-cluster``: the
connection spark_default points at the master), so both streams and the recovery's
replay are applications of that master whose executors its worker launches. All the
while a thread reads every process's command line: no secret may be on one."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import struct
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from demo.env_files import read_env_file
from demo.ledger_stages import KILL_BURST
from tests.conftest import STATE_DIR
from tests.helpers.cmdline import CmdlineWatch

ROOT = Path(__file__).resolve().parents[2]
# The story takes 6-7 minutes on a quiet machine and up to 15 beside the other xdist worker's
# tests; its fixture runs under the first test's timeout, which must outlast the story's own
# bound (the subprocess's 2400 s below), or pytest ends it in its last stage.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(2500)]


@dataclass
class DemoRun:
    result: dict
    watch: CmdlineWatch
    seconds: float
    console: str


def _source_password(stack: dict[str, str]) -> str:
    return Path(stack["EOS_SOURCE_PG_PASSWORD_FILE"]).read_text().strip()


def _secrets(stack: dict[str, str]) -> dict[str, str]:
    """What must never be on a command line: the database password and Airflow's own secrets
    (written by scripts/airflow.sh env, which the demo's `airflow.sh start` keeps)."""
    subprocess.run(["bash", "scripts/airflow.sh", "env"], cwd=ROOT, check=True, capture_output=True, timeout=120)
    home = Path(read_env_file(STATE_DIR / "airflow.env")["AIRFLOW_HOME"])
    return {"database password": stack["EOS_PG_PASSWORD"],
            "source database password": _source_password(stack),
            "Airflow UI password": json.loads((home / "ui-passwords.json").read_text())["admin"],
            "Airflow JWT secret": (home / "jwt.secret").read_text().strip()}


@pytest.fixture(scope="module")
def demo_run(stack: dict[str, str], spark_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    out = tmp_path_factory.mktemp("demo") / "result.json"
    watch = CmdlineWatch(_secrets(stack), executor_marker=stack["EOS_SPARK_WORKER_URL"])
    watch.start()
    started = time.monotonic()
    try:
        completed = subprocess.run(
            # The smallest size that shows every stage: the first production's fifth transaction of
            # 1000 is its aborted one (abort_every=5). The SIGKILL lands mid-stream at any size (the
            # story commits a burst just before it); the recovery replays the 2000 events committed
            # after the snapshot and what its live feed commits.
            [sys.executable, "-m", "demo.story", "--spark-cluster", "--events", "5000", "--json", str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=2400)
    finally:
        seconds = time.monotonic() - started
        watch.stop()
        subprocess.run(["bash", "scripts/airflow.sh", "stop"], cwd=ROOT, check=False)
        # Back to spark_default = local[*] for whatever reads airflow.env next.
        subprocess.run(["bash", "scripts/airflow.sh", "env"], cwd=ROOT, check=False, capture_output=True)
    print(f"\ndemo on {spark_cluster}: {seconds:.0f} s; command lines read: {watch.seen}, executors seen: "
          f"{len(watch.executors)} (applications {sorted(watch.executor_apps)}), hits: {len(watch.hits)}")
    # Where the time went: the story's stage lines carry their start times.
    print("\n".join(line for line in completed.stdout.splitlines() if line.startswith("[")))
    # The console shows stages and the report; the story's log holds the rest (tracebacks included).
    console_log = STATE_DIR / "demo" / "story.log"
    # The console as a user sees it, kept for the README's sample report.
    console_log.parent.mkdir(parents=True, exist_ok=True)
    (console_log.parent / "console.txt").write_text(completed.stdout)
    log_tail = console_log.read_text()[-4000:] if console_log.is_file() else ""
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:] + log_tail
    # A clean console: no librdkafka line (%4|...), no raw log lines among the stages and the report.
    assert not re.search(r"^%\d\|", completed.stdout + completed.stderr, re.MULTILINE), completed.stderr[-2000:]
    return DemoRun(json.loads(out.read_text()), watch, seconds, completed.stdout)


@pytest.fixture(scope="module")
def demo_result(demo_run: DemoRun) -> dict:
    return demo_run.result


def test_the_story_ends_exactly_once(demo_result: dict) -> None:
    assert demo_result["exact"] is True and demo_result["ledger_exact"] is True
    assert demo_result["duplicates"] == 0 and demo_result["missing"] == 0
    assert demo_result["balances_exact"] is True
    assert demo_result["dead_lettered"] == 1
    # The SIGKILL landed mid-stream: the driver was frozen before the burst was committed, so the
    # whole burst (and its commit markers) was in Kafka and not applied when it died.
    assert demo_result["offsets behind at the SIGKILL"] >= KILL_BURST
    damage = demo_result["damage_seen_before_recovery"]
    assert damage["duplicated"] > 0 and damage["missing"] > 0 and damage["balances_wrong"] > 0


def test_the_orders_pipeline_ends_exactly_once(demo_result: dict) -> None:
    orders = demo_result["orders"]
    assert orders["exact"] is True and orders["sales_exact"] is True and orders["sales_keys"] > 0
    assert orders["duplicates"] == 0 and orders["missing"] == 0
    assert orders["lines_aborted"] > 0
    assert orders["lines_committed_in_kafka (audit)"] == orders["lines_committed_by_producers"]
    # One malformed and two rejected lines (the spec's transform refuses them): quarantined, not in the target.
    assert orders["dead_lettered"] == 3
    assert orders["rows_in_db"] == orders["lines_committed_by_producers"] - 3


def test_orders_streamed_through_the_ledger_recovery(demo_result: dict) -> None:
    """Recovering one pipeline never stops another: the orders stream kept its one DAG run and its
    engine process, and committed batches while the ledger's recovery held the ledger stopped."""
    through = demo_result["orders"]["through_the_ledger_recovery"]
    assert through["ledger_stopped_s"] > 0
    assert through["stream_runs"] == 1 and through["stream_run_state_after"] == "running"
    assert through["same_engine"] is True
    assert through["batches_while_ledger_stopped"] >= 1 and through["records_while_ledger_stopped"] > 0


def test_the_orders_engine_shows_its_latency(demo_result: dict) -> None:
    """The orders stream runs on the continuous engine: the report says how long each feed tick's
    committed lines took to be all in the target, measured from outside by the story."""
    latency = demo_result["orders"]["committed_to_visible (continuous engine)"]
    assert latency["ticks"] >= 10, latency
    assert 0 < latency["p50_ms"] <= latency["p90_ms"] <= latency["max_ms"], latency
    # Far below the Spark streams' 2 s trigger: the point of choosing this engine for this stream.
    assert latency["p50_ms"] < 1000, latency


def test_the_mirror_equals_its_source_through_connect_and_driver_kills(demo_run: DemoRun) -> None:
    """The change stream: every mirror table equals its source table and the aggregate its GROUP BY
    (EXCEPT ALL both ways, compared by the story once the stream reached the change topics' last
    stable offsets), after the Connect worker and the stream's driver were each SIGKILLed."""
    mirror = demo_run.result["mirror"]
    assert mirror["exact"] is True and demo_run.result["exact"] is True
    assert set(mirror["tables"]) == {"customers", "order_lines", "events"}, mirror["tables"]
    assert all(seen["source_rows"] > 0 and seen["differ"] == 0 for seen in mirror["tables"].values()), mirror
    aggregate = mirror["aggregate"]
    assert aggregate["table"] == "sku_totals" and aggregate["groups"] > 0 and aggregate["differ"] == 0, aggregate
    assert mirror["dead_lettered"] == 0
    # The application kept writing through both kills: transactions before and after them.
    assert 0 < int(mirror["connect_worker_sigkilled"].split(" after ")[1].split()[0]) < mirror["source_transactions"]
    assert mirror["driver_sigkilled"].startswith("pid(s) [") and mirror["driver_runs"] >= 2, mirror
    assert mirror["change_events_in_kafka"] > mirror["source_transactions"], mirror
    # The console's report says it, one line per table and one for the aggregate.
    for table in ("customers", "order_lines", "events"):
        rows = re.search(rf"^ *{table} vs its source: (\d+) rows, rows that differ: 0$", demo_run.console, re.M)
        assert rows and int(rows[1]) == mirror["tables"][table]["source_rows"], demo_run.console[-3000:]
    assert re.search(r"^ *sku_totals vs GROUP BY sku: \d+ groups, rows that differ: 0$", demo_run.console, re.M)


def test_the_source_password_is_in_no_log(stack: dict[str, str], demo_run: DemoRun) -> None:
    """The connector's password is a reference the Connect worker resolves from its file: it is in
    neither the worker's log nor the story's."""
    password = _source_password(stack)
    for log in (STATE_DIR / "connect" / "connect.log", STATE_DIR / "demo" / "story.log"):
        assert password not in log.read_text(errors="replace"), log


def test_dag_runs_end_in_the_expected_states(demo_result: dict) -> None:
    states = {name.split(" ")[0]: state for name, state in demo_result["runs"].items()}
    assert states["eos_health__ledger"] == "failed"  # it caught the stuck LSO
    # ... and its task's log, read through Airflow's API, says so (the report shows one line of it
    # and the path of the whole log; --json keeps the whole text).
    health_logs = demo_result["failure_logs"]["eos_health__ledger"]
    assert any(re.search(r"Kafka partitions with a (stuck last stable offset|hanging transaction)", log)
               for log in health_logs.values()), health_logs
    assert states["eos_snapshot__ledger"] == "success"
    assert states["eos_recovery__ledger"] == "success"
    assert states["eos_stop__orders"] == "success"
    assert states["eos_stream__orders"] == "success"  # it ended on the stop request, not before
    # The mirror's one stream run outlived its driver's SIGKILL and ended on its stop request.
    assert states["eos_stop__shop_mirror"] == "success" and states["eos_stream__shop_mirror"] == "success"
    # Every ledger stream run, the first and the one the recovery resumed, ran until a stop asked.
    ledger = [state for name, state in demo_result["runs"].items() if name.startswith("eos_stream__ledger ")]
    assert ledger == ["success", "success"], demo_result["runs"]
    assert demo_result["stuck LSO detected after (s)"] > 0
    assert "(log: " in demo_result["health_failed_because"] and "\n" not in demo_result["health_failed_because"]


def test_the_targets_asset_events_carry_the_committed_offsets(demo_result: dict) -> None:
    """The watcher on the triggerer put an event on both ledger targets each time the committed
    offsets moved; its last one names exactly the offsets the (exact) target ended with; the
    recovery announced itself once; the downstream DAG scheduled on the targets ran and was told."""
    assets = demo_result["assets"]
    assert len(assets["target_assets"]) == 2
    assert all(uri.startswith("postgres://") and uri.split("/")[-2] == "public" for uri in assets["target_assets"])
    per_target = set(assets["events_per_target"].values())
    assert len(per_target) == 1 and per_target.pop() >= 3, assets["events_per_target"]  # one trigger, both tables
    watched = [e for e in assets["events"] if e["from_trigger"]]
    assert watched and watched[-1]["offsets"] == assets["stored_offsets"]
    for before, after in itertools.pairwise(watched):
        if after["change"] == "advanced":
            assert all(after["offsets"][t][p] >= o for t, parts in before["offsets"].items()
                       for p, o in parts.items()), (before, after)
    recovered = [e for e in assets["events"] if e["change"] == "recovered"]
    assert len(recovered) == 1 and not recovered[0]["from_trigger"] and recovered[0]["snapshot_id"]
    assert set(assets["downstream_runs"]) == {"success"}, assets["downstream_runs"]
    assert assets["downstream_told"] >= 1


def test_lineage_shows_topic_to_pipeline_to_tables_and_the_audit(demo_result: dict) -> None:
    """The OpenLineage provider's listener (file transport, scripts/airflow.sh) got, from the operators'
    get_openlineage_facets_on_*: each stream reads its topic and writes its tables; the replay writes
    the ledger's; the audit reads them, with its assertions, all passed on the exact target."""
    jobs = demo_result["lineage"]["jobs"]

    def names(datasets: list[str]) -> set[str]:
        return {d.rsplit("/", 1)[-1] for d in datasets}

    ledger = {"eos.public.ledger_events", "eos.public.account_balances"}
    stream = jobs["eos_stream__ledger.run_pipeline"]
    assert names(stream["inputs"]) == {"ledger.events"} and names(stream["outputs"]) == ledger
    assert all(d.startswith("kafka://") for d in stream["inputs"])
    assert all(d.startswith("postgres://") for d in stream["outputs"])
    assert {"START", "COMPLETE"} <= set(stream["event_types"])
    orders = jobs["eos_stream__orders.run_pipeline"]
    assert names(orders["inputs"]) == {"orders.events"}
    assert names(orders["outputs"]) == {"eos.orders.order_lines", "eos.orders.sku_store_sales"}
    replay = jobs["eos_recovery__ledger.replay"]
    assert names(replay["outputs"]) == ledger and replay["event_types"].get("COMPLETE") == 1
    audit = jobs["eos_recovery__ledger.audit"]
    assert names(audit["inputs"]) == {"ledger.events", *ledger} and audit["outputs"] == []
    assert audit["quality"] == {
        "eos.public.ledger_events": {"no_duplicates": True, "no_missing": True, "no_valid_record_quarantined": True},
        "eos.public.account_balances": {"aggregates_exact": True, "no_valid_record_quarantined": True},
    }


def test_the_lso_sensor_deferred_to_the_triggerer(demo_result: dict) -> None:
    assert any(task.startswith("eos_health__ledger.") for task in demo_result["tasks_seen_deferred"])


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_the_html_report_renders(demo_result: dict, tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "chromium is missing: scripts/install.sh installs Debian's chromium"
    report = Path(demo_result["report_html"])
    html = report.read_text()
    assert "<svg" in html and "EXACTLY ONCE" in html
    assert "Final audit: ledger" in html and "Final audit: orders" in html
    assert "Final comparison: shop_mirror" in html and "sku_totals vs GROUP BY sku" in html
    assert "orders.events[0]" in html and "orders rows/s" in html
    shot = tmp_path / "report.png"
    subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1000,1600", f"--screenshot={shot}",
         report.as_uri()],
        check=True, capture_output=True, timeout=120)
    assert _png_size(shot) == (1000, 1600)
    assert shot.stat().st_size > 30_000  # charts and tables, not a blank page


def test_no_secret_on_any_command_line(demo_run: DemoRun) -> None:
    """Read all along, every process's command line: Airflow's services and task processes,
    spark-submit, the drivers, the worker and the executors it launched, pg_dump, pg_restore."""
    assert demo_run.watch.seen > 10_000
    assert demo_run.watch.hits == [], demo_run.watch.hits


def test_both_streams_and_the_replay_ran_on_the_cluster(demo_run: DemoRun, spark_cluster: str) -> None:
    spark = demo_run.result["spark"]
    assert spark["master"] == spark_cluster
    apps = spark["applications"]
    names = Counter(app["name"] for app in apps)
    # The ledger: its first driver, the one that replaced the SIGKILLed one, the one its recovery
    # resumed. The recovery's replay: an application of its own. The mirror: its first driver and the
    # one that replaced the SIGKILLed one. The orders stream runs on the continuous engine, in its
    # stream task: no application of the cluster.
    assert names["eos-replay-ledger"] == 1, names
    assert names["eos-ledger"] >= 3 and names["eos-shop_mirror"] >= 2, names
    assert set(names) == {"eos-ledger", "eos-replay-ledger", "eos-shop_mirror"}, names
    # None sets spark.cores.max: the master's spark.deploy.defaultCores (scripts/stack.sh) gives each
    # one core, so the two Spark streams and the replay share the 3-core worker.
    assert {app["cores"] for app in apps} == {1}, apps
    # Executors launched by this cluster's worker were seen for every one of them (the replay's too).
    assert demo_run.watch.executors
    missing = [app for app in apps if app["id"] not in demo_run.watch.executor_apps]
    assert not missing, (missing, sorted(demo_run.watch.executor_apps))


def test_each_stream_task_links_to_its_own_driver_ui(demo_run: DemoRun) -> None:
    """Read through Airflow's API (/links) while both streams ran on the cluster: a link per stream
    task, on the drivers' host (loopback here), on ports of their own, each serving Spark's UI."""
    import ipaddress
    import socket
    import urllib.parse

    uis = demo_run.result["spark"]["driver_ui"]
    assert set(uis) == {"eos_stream__ledger", "eos_stream__shop_mirror"}, uis
    addresses = [urllib.parse.urlsplit(ui["link"]) for ui in uis.values()]
    # The driver's host as Spark names it (spark.driver.host unset on a cluster master: the name
    # SPARK_LOCAL_IP=127.0.0.1 resolves to, "localhost" here), so it must resolve to loopback.
    assert all(ipaddress.ip_address(socket.gethostbyname(a.hostname or "")).is_loopback for a in addresses), uis
    assert len({a.port for a in addresses}) == 2, uis
    assert all(ui["serves"] for ui in uis.values()), uis
