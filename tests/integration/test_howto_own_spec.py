"""docs/howto_own_spec.md, followed word for word: its files are taken from the page, its
commands run as the page gives them, and the pipeline streams the team's own topic into the
team's own tables exactly once.

The one substitution: the definition's ``checkpoint_dir`` goes under the test's temporary
directory instead of ``/var/lib/eos``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from psycopg2 import sql

from spark_apps.ledger.generator import ensure_topic
from tests.conftest import ROOT
from tests.helpers.kafka import wait_for_markers
from tests.integration.test_recovery_dag import _airflow_env, _dag_test
from tests.streaming import audit, pg_connect

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PAGE = ROOT / "docs" / "howto_own_spec.md"
FILE_BLOCK = re.compile(r"```\w+ file=(\S+)\n(.*?)```", re.S)
COMMAND_BLOCK = re.compile(r"```bash\n(.*?)```", re.S)


def _page() -> tuple[dict[str, str], list[str]]:
    text = PAGE.read_text()
    return dict(FILE_BLOCK.findall(text)), [c.strip() for c in COMMAND_BLOCK.findall(text)]


def _clean(stack: dict[str, str]) -> None:
    """The page's names are fixed: a rerun starts from nothing."""
    conn = pg_connect(stack)
    conn.autocommit = True
    with conn.cursor() as cur:
        for schema in ("shop", "shop_eos"):
            cur.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    conn.close()
    admin = AdminClient({"bootstrap.servers": stack["EOS_KAFKA_BOOTSTRAP"]})
    if "shop.payments" in admin.list_topics(timeout=30).topics:
        admin.delete_topics(["shop.payments"])["shop.payments"].result(30)


def _run(command: str, repo: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    bin_dir = Path(sys.executable).parent
    return subprocess.run(["bash", "-c", command], cwd=repo, capture_output=True, text=True, timeout=300,
                          env={**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', os.environ['PATH'])}"})


def test_the_howto_from_an_empty_repository_to_an_exact_pipeline(stack: dict, tmp_path: Path) -> None:
    files, commands = _page()
    assert set(files) == {"acme_pipelines/payments.py", "pipelines/payments.yaml"}, files
    repo = tmp_path / "acme-pipelines"
    (repo / "acme_pipelines").mkdir(parents=True)
    (repo / "acme_pipelines" / "__init__.py").write_text("")
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    definition = repo / "pipelines" / "payments.yaml"
    definition.write_text(definition.read_text().replace("/var/lib/eos/checkpoints", str(tmp_path / "checkpoints")))
    _clean(stack)

    # 3. eos validate, exactly as the page gives it.
    validate = next(c for c in commands if "eos validate" in c)
    result = _run(validate, repo, dict(os.environ))
    assert (result.returncode, result.stdout) == (0, "ok   payments\n"), result.stdout + result.stderr

    # 4. eos preflight against the deployment: connections, the definition directory, the store.
    env = _airflow_env(stack, repo / "pipelines", tmp_path / "store")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(repo)])
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], "shop.payments", partitions=3)
    preflight = next(c for c in commands if "eos preflight" in c)
    result = _run(preflight, repo, env)
    assert result.returncode == 0, result.stdout + result.stderr
    # Airflow's own log lines (its secrets masker's warnings) may come between the checks' lines.
    checks = [line for line in result.stdout.splitlines() if line.startswith(("ok ", "FAIL "))]
    assert [line.split(":")[0] for line in checks] == [
        "ok   definition", "ok   kafka", "ok   postgres", "ok   snapshot store", "ok   spark"], result.stdout
    assert "shop.payments (3 partitions)" in result.stdout

    # The team's payments, keyed by customer as the page says.
    producer = Producer({"bootstrap.servers": stack["EOS_KAFKA_BOOTSTRAP"], "enable.idempotence": True})
    for i in range(1500):
        customer = f"c{i % 40:02d}"
        producer.produce("shop.payments", key=customer, value=json.dumps(
            {"payment_id": f"p{i}", "customer": customer, "amount_cents": 100 + i,
             "paid_at": f"2026-11-25T{i // 3600 % 24:02d}:{i // 60 % 60:02d}:{i % 60:02d}Z"}))
    producer.produce("shop.payments", key="c00", value=b'{"payment_id": "bad", "customer": "c00"}')
    producer.flush(30)
    wait_for_markers(stack["EOS_KAFKA_BOOTSTRAP"], "shop.payments")

    # 5. Run it: the stream DAG the factory made of the definition.
    [run] = _dag_test(env, [["eos_stream__payments", {}]], tmp_path)
    assert run["state"] == "success", run

    conn = pg_connect(stack)
    with conn.cursor() as cur:
        cur.execute("SELECT count(*), sum(amount_cents) FROM shop.payments")
        assert cur.fetchone() == (1500, sum(100 + i for i in range(1500)))
        cur.execute("SELECT sum(paid_cents), sum(payments), count(*) FROM shop.customer_totals")
        assert cur.fetchone() == (sum(100 + i for i in range(1500)), 1500, 40)
        cur.execute("SELECT count(*) FROM shop_eos.dead_letters")
        assert cur.fetchone() == (1,)  # the payment without amount_cents and paid_at
    conn.close()

    from airflow_provider_eos.utils.pipeline_definition import load_definition

    config = load_definition(definition).app_config(
        kafka_bootstrap=stack["EOS_KAFKA_BOOTSTRAP"],
        postgres={"host": stack["EOS_PG_HOST"], "port": int(stack["EOS_PG_PORT"]), "dbname": stack["EOS_PG_DB"],
                  "user": stack["EOS_PG_USER"]})
    report = audit(config, tmp_path, env_extra={"PYTHONPATH": env["PYTHONPATH"],
                                                "EOS_PG_PASSWORD": stack["EOS_PG_PASSWORD"]})
    assert report["ok"], report
    assert report["summary"]["committed_records"] == 1501 and report["summary"]["dead_lettered"] == 1
