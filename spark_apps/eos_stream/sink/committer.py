"""The committer: finishes a batch the writer prepared (``writer.PreparedBatch``)."""

from __future__ import annotations

from spark_apps.eos_stream.sink.writer import PreparedBatch


class BatchCommitter:
    """Finishes a prepared batch. Committing is the single point where data and
    offsets become visible together."""

    def commit(self, prepared: PreparedBatch) -> None:
        if prepared.transaction_id is None:
            prepared.conn.commit()
        else:
            prepared.conn.tpc_commit()  # COMMIT PREPARED of this batch's id


