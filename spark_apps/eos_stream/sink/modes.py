"""The delivery modes: what each guarantees, as switches on the sink's one apply path.

The preflight refuses a mode a pipeline's targets cannot have, the driver builds the sink
with one, and the audit reads from it whether offsets are stored.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeliveryMode:
    """What a delivery mode guarantees, as switches on the one apply path.

    :param stores_offsets: next offsets commit with the data; the DB is the replay point.
    :param dedupe: keep one staged copy per Kafka record.
    :param upsert_rows: row targets ignore a record they already hold.
    :param allows_aggregates: aggregate targets are safe under this mode.
    :param two_phase: PREPARE TRANSACTION, then COMMIT PREPARED (needs max_prepared_transactions > 0).
    """

    name: str
    stores_offsets: bool
    dedupe: bool
    upsert_rows: bool
    allows_aggregates: bool
    two_phase: bool = False


MODES = {
    "at_least_once": DeliveryMode("at_least_once", False, False, False, True),
    "idempotent": DeliveryMode("idempotent", False, True, True, False),
    "exactly_once": DeliveryMode("exactly_once", True, True, False, True),
    "two_phase": DeliveryMode("two_phase", True, True, False, True, two_phase=True),
}


