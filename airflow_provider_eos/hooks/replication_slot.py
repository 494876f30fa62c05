"""Reads a PostgreSQL replication slot as the source of a change stream: the WAL it holds back,
in bytes and age (what fills a source's disk when its consumer is stuck)."""

from __future__ import annotations

from typing import Any

import psycopg2
from airflow.providers.postgres.hooks.postgres import PostgresHook

from airflow_provider_eos.utils.cdc_health import SlotState

_SLOT_SQL = """
SELECT slot_name, database, plugin, active, wal_status,
       COALESCE(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::bigint AS held_bytes,
       pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint AS unconfirmed_bytes,
       pg_walfile_name(restart_lsn) AS restart_segment,
       pg_walfile_name(pg_current_wal_lsn()) AS current_segment
  FROM pg_replication_slots
 WHERE slot_name = %s
"""

# When the WAL segment holding the slot's restart_lsn was last written, i.e. finished: PostgreSQL
# keeps no time per slot, so this bounds the age of the oldest WAL the slot holds from below.
# pg_ls_waldir() needs superuser or pg_monitor.
_SEGMENT_AGE_SQL = "SELECT EXTRACT(EPOCH FROM now() - modification)::float8 FROM pg_ls_waldir() WHERE name = %s"


class ReplicationSlotHook(PostgresHook):
    """
    A PostgreSQL connection to the source database of a change stream, for its replication slot.

    The role needs ``pg_monitor`` (or to be a superuser) for the age of the WAL a slot holds;
    without it the age is unknown and only the bytes are judged.

    :param postgres_conn_id: The connection to the source database, defaults to "postgres_default".
    """

    hook_name = "EOS change-data-capture source (replication slots)"

    def slot_state(self, slot_name: str) -> SlotState | None:
        """The slot measured against the current WAL position, or None when it does not exist."""
        conn = self.get_conn()
        try:
            with conn.cursor() as cur:
                cur.execute(_SLOT_SQL, (slot_name,))
                row = cur.fetchone()
                if row is None:
                    return None
                names = [c.name for c in cur.description or ()]
                slot = dict(zip(names, row, strict=True))
                age = self._segment_age(cur, slot)
        finally:
            conn.close()
        return SlotState(
            slot_name=slot["slot_name"], database=slot["database"], plugin=slot["plugin"],
            active=bool(slot["active"]), held_bytes=int(slot["held_bytes"]),
            unconfirmed_bytes=None if slot["unconfirmed_bytes"] is None else int(slot["unconfirmed_bytes"]),
            age_seconds=age, wal_status=slot["wal_status"],
        )

    def _segment_age(self, cur: Any, slot: dict[str, Any]) -> float | None:
        if slot["restart_segment"] is None:
            return None
        if slot["restart_segment"] == slot["current_segment"]:
            return 0.0  # it holds less than one segment: nothing older than the WAL being written
        try:
            cur.execute(_SEGMENT_AGE_SQL, (slot["restart_segment"],))
        except psycopg2.errors.InsufficientPrivilege:
            self.log.warning("the role may not read the WAL directory (needs pg_monitor): the age of "
                             "replication slot %r is unknown; only its bytes are judged", slot["slot_name"])
            return None
        row = cur.fetchone()
        return None if row is None else max(0.0, float(row[0]))
