"""The engines: three peers that run a pipeline from Kafka into PostgreSQL.

- ``spark``: Spark Structured Streaming under spark-submit (``app.py`` is the file it runs);
  ``engine: spark``, the default. Throughput across executors, a micro-batch every
  ``trigger_interval``, or ``trigger: availableNow`` to the end of the topics.
- ``continuous``: one Python process, no Spark (``python -m spark_apps.eos_stream.engines.continuous``);
  ``engine: continuous``. Tens of milliseconds from Kafka's commit to the target's.
- ``direct_replay``: a recovery's replay to Kafka's last stable offsets in the caller's process,
  no Spark (the recovery's ``replay_engine``, or its size under ``auto``).

Each claims the pipeline the same way and commits every batch through the one sink
(``BatchSink.process``). What they share is written once: the start (``start``: spec, mode,
run id, the claim, a consumer) and the ``batch`` event, the progress row and the stop-and-fence
poll (``shared``). No engine imports another (``tests/unit/test_import_rules.py``). Each engine's
module holds its own failure transitions (S1.. for Spark, C1.. continuous, R1.. the replay), on
top of the sink's (``sink/batch_sink.py``: 1-10, P1-P6). Exit codes: ``run/entry.py``.
"""
