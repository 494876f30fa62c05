"""What the provider reads and writes in the target database, each module beside the table or
lock it owns. Every function takes an
:class:`~airflow_provider_eos.hooks.eos_postgres.EosPostgresHook` (built for the pipeline's
``meta_schema`` where the table lives there) and opens its own short connection.

* :mod:`.meta`: the bookkeeping tables' names and DDL;
* :mod:`.offsets`: the offsets the pipeline has applied;
* :mod:`.progress`: the newest batch's progress row;
* :mod:`.dead_letters`: the quarantined records;
* :mod:`.stop_requests`: the control table's stop request;
* :mod:`.running_lock` and :mod:`.supervisor_lock`: who runs and who supervises a pipeline;
* :mod:`.activity`: the four of a stream's signs of life read at once;
* :mod:`.lso_watch`: the health check's memory of stuck partitions;
* :mod:`.prepared_transactions`: the database's in-doubt two-phase transactions.

The recovery lock's rows live with the lock, in :mod:`airflow_provider_eos.recovery.lock`.
"""
