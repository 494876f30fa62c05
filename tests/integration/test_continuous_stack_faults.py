"""The continuous engine (``engines/continuous.py``, C10, C11) through a PostgreSQL immediate restart
while a transactional producer writes, and through a broker SIGKILL and restart: it must not
exit at all, and the audit must end exact. These kill or restart daemons of the stack: marked
``stack_faults``, run alone after the other tests (scripts/test.sh), never on a shared stack.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from spark_apps.ledger.generator import ensure_topic, produce_ledger
from tests.helpers.continuous import LedgerProducer, stop_when_caught_up, wait_for_batches
from tests.helpers.kafka import delete_topics
from tests.helpers.stack_faults import kill_broker, restart_postgres_immediate
from tests.streaming import AppRun, audit, ledger_order, pg_connect, pipeline_config, start_continuous

pytestmark = [pytest.mark.integration, pytest.mark.stack_faults, pytest.mark.timeout(600)]


@pytest.fixture
def engine(stack: dict, tmp_path: Path, unique_name: str) -> Iterator[tuple[dict, AppRun]]:
    """An engine on a new 2-partition topic (SIGKILLed at the end if a failed test left it)."""
    name = f"cfault{unique_name}"
    topic = f"ledger.{name}"
    ensure_topic(stack["EOS_KAFKA_BOOTSTRAP"], topic, partitions=2)
    config = pipeline_config(stack, tmp_path, name, topics=[topic], trigger="continuous",
                             max_offsets_per_trigger=300, stop_poll_seconds=0.5)
    produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], 600, topic=topic, batch_size=50, abort_every=4, seed=0)
    run = start_continuous(config, tmp_path, label="faults")
    wait_for_batches(run, 1, 120)
    assert run.process.poll() is None, run.log()[-3000:]
    yield config, run
    if run.process.poll() is None:
        run.kill()
    delete_topics(stack["EOS_KAFKA_BOOTSTRAP"], topic)


def _exact_without_exit(stack: dict, config: dict, run: AppRun, tmp_path: Path, events: int) -> None:
    stop_when_caught_up(stack, config, run, config["topics"])
    report = audit(config, tmp_path)
    order = ledger_order(stack, config["target_schema"])
    summary = report["summary"]
    print(f"\n{config['pipeline']}: engine exits=0 resumes={len(run.events('resume'))} "
          f"retries={len(run.events('retry'))} kafka outages={len(run.events('kafka_unavailable'))} "
          f"summary={summary} order={order}")
    assert len(run.events("resume")) == 1 and not run.events("error"), run.log()[-3000:]
    assert summary["committed_records"] == events and summary["duplicated"] == 0 and summary["missing"] == 0
    assert report["aggregates"]["account_balances"]["keys_wrong"] == 0
    assert order["out_of_order_accounts"] == 0 and report["ok"], report


def test_a_postgres_immediate_restart_does_not_end_the_engine(stack: dict, tmp_path: Path,
                                                             engine: tuple[dict, AppRun]) -> None:
    config, run = engine
    producer = LedgerProducer(stack["EOS_KAFKA_BOOTSTRAP"], config["topics"][0], 1800, first_seq=600)
    producer.start()
    wait_for_batches(run, 3, 60)
    restart = restart_postgres_immediate(lambda: pg_connect(stack))
    print(f"\nPostgreSQL down {restart.down_seconds:.1f}s")
    producer.join(300)
    assert producer.error is None and run.process.poll() is None, run.log()[-3000:]
    _exact_without_exit(stack, config, run, tmp_path, 2400)


def test_a_broker_sigkill_and_restart_does_not_end_the_engine(stack: dict, tmp_path: Path,
                                                             engine: tuple[dict, AppRun]) -> None:
    config, run = engine
    restart = kill_broker()
    print(f"\nbroker down {restart.down_seconds:.1f}s")
    assert run.process.poll() is None, run.log()[-3000:]
    produce_ledger(stack["EOS_KAFKA_BOOTSTRAP"], 600, topic=config["topics"][0], batch_size=50, abort_every=4,
                   seed=600, first_seq=600)
    _exact_without_exit(stack, config, run, tmp_path, 1200)
