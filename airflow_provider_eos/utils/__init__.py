"""Logic of the provider that loads without Airflow, unit-tested on its own: no module here
imports Airflow when it is imported (tests/unit/test_utils_without_airflow.py). Two call into
Airflow inside the one function that needs it: ``lineage.operator_lineage`` (OpenLineage's
classes) and ``provider_config`` (the ``[eos]`` section of Airflow's config)."""
