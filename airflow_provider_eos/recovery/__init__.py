"""The recovery protocol's own code, apart from the operators that run it (issue 23 moves the rest
here: dump, swap, aside and rollback still live in ``hooks/pg_tools.py``, the manifest and store in
``utils/snapshot_store.py``).

* ``guards``: who may still write: in-doubt batches of dead drivers, the epoch bump, the pipeline
  lock's holders.
* ``tables``: which tables a snapshot takes, and how a snapshot's differ from the pipeline's now.
* ``retention``: whether Kafka still holds everything a replay from stored offsets needs.
"""
