"""The recovery protocol in one place: snapshots, restore, finalize and rollback, and the guards
around them. Its functions take the provider's hooks (``PgToolsHook`` for PostgreSQL sessions and
the client tools, ``KafkaOffsetsHook`` for Kafka), as Flink's ``XaGroupOpsImpl`` takes its
``XaFacade``; the operators only read their arguments and call these.

Modules, in the order a snapshot id travels through a recovery:

* ``manifest``: what a snapshot holds (``SnapshotManifest``), choosing one (``select``), whether
  it is one of the target database (``identity_problem``).
* ``store``: where snapshots lie (``SnapshotStore``), who may write there, retention.
* ``tables``: which tables a snapshot takes, and how a snapshot's differ from the pipeline's now.
* ``checksums``: the per-table count and checksum the manifest records and every restore checks.
* ``catalog``: the stored offsets, other pipelines in the meta schema, the database's identity,
  objects depending on the pipeline's tables.
* ``dump``: taking a snapshot (one exported PostgreSQL snapshot, ``pg_dump`` from it).
* ``lock``: the recovery lock (one recovery of a target at a time) and the target's keys.
* ``guards``: who may still write: the running lock, in-doubt batches, the epoch bump.
* ``retention``: whether Kafka still holds everything a replay from stored offsets needs.
* ``replay_engine``: which engine replays (``auto``: ``direct`` for a small replay, ``spark`` above).
* ``restore``: the restore's steps, from choosing the snapshot to the swap.
* ``scratch``: the proof of a dump in a scratch database (when a snapshot is taken, and in a
  restore of a snapshot without one).
* ``swap``: the swap, in ONE transaction of the target database.
* ``aside``: the replaced state kept aside, then dropped (finalize) or put back (rollback).

Failure transitions of a restore and the steps after it: what a crash at each point leaves
behind, and why a rerun is still correct ("rerun" is the same DAG run's task cleared or retried,
which re-enters the recovery lock). The table for every task of the recovery DAG is in
docs/recovery.md ("Failure-transition table"); the sink's is in ``spark_apps/eos_stream/sink/batch_sink.py``.

1. before the swap (``restore.choose`` and the refusals: a store root others may write to, a
   manifest of another database, tables that differ from the snapshot's, dependents; the
   running lock, ``store.fetch_dump`` and its SHA-256 check): nothing in the target changed. A
   dead worker's running lock and session die with its connection. Rerun: starts over.
2. during the scratch validation (``scratch.validate_in_scratch``; only for a snapshot whose
   manifest holds no proof the restore can trust, ``scratch.trusted_proof``; it runs beside steps
   3 and 4, the swap's COMMIT waits for its verdict and a failed one rolls the swap back): a
   scratch database ``eos_scratch_<hash of the target key>_<random>`` may be left, with whatever
   step 3 or 4 left at the same moment. Rerun: the next proof of the target drops it (its
   liveness lock died with the worker's session), and proves again.
3. while rolling back in-doubt two_phase transactions (``guards.roll_back_in_doubt``): each
   ROLLBACK PREPARED is its own commit; some may be left. Rerun: rolls back the rest (they belong
   to the state being replaced either way).
4. inside the swap transaction, before COMMIT was sent (``swap.swap_in``: prelude, restore
   script, postlude, the scratch's verdict, the retention re-check): psql's stdin closes with
   the worker, psql exits, and the server rolls back a transaction whose client went away: old
   tables, old epoch, no aside schema. A retention gap, a snapshot the scratch refused or a
   validation error ends here on purpose (ROLLBACK). Rerun: restores again.
5. COMMIT sent, its outcome unknown to the worker: either the old state (as in 4) or the new one
   (snapshot in place, epoch bumped, old tables in the aside schema with ``keep_old``, else
   dropped in the same transaction). Rerun: restores the same snapshot again, which ends in the
   same state. With ``keep_old`` it finds the aside schema its own run kept
   (``aside.kept_aside_of_run``: the record in the schema's comment names the run) and reuses
   it: the current tables are dropped instead of moved, so that aside schema still holds the
   state from before the run, not a copy of the snapshot, and the XCom names it again.
6. after COMMIT, before the XCom is written: as the committed case of 5.
7. finalize (``aside.finalize_aside``), before its DROP SCHEMA commits: the aside schema is
   intact. Rerun: drops it; after the commit a rerun finds it gone and reports that.
8. rollback (``aside.rollback_swap``), before its transaction commits: nothing changed (one
   transaction: drop the restored tables, move the aside tables back, refill the tables the
   snapshot lacked from their copies (``allow_table_changes``), bump the epoch, mark the aside
   record ``rolled_back_at``). After the commit a rerun reads the mark and returns at once,
   instead of dropping the tables it had just put back. A rollback after finalize fails: the old
   state is gone.

A snapshot (``dump.take_snapshot``) writes nothing to the target: a crash leaves at most a
snapshot directory without a manifest, which no restore selects and retention removes, or the
scratch database of its proof, which the next proof of the target drops.

While the stream is stopped for recovery a supervisor cannot slip a driver in: the stop request
stays set, a driver starting meanwhile waits for the running lock the restore holds (then exits
1), and a driver that somehow still writes is fenced by the epoch bumps of the stop step and of
the swap.
"""
