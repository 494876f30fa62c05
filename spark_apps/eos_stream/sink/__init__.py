"""The PostgreSQL sink: staging (executors), apply (one transaction), commit.

Shaped like Flink's JDBC exactly-once sink: a writer stages and *prepares* a
batch (everything applied inside an open transaction), a committer finishes it
idempotently, and every database detail sits behind ``BatchSink``.
"""
