"""Every pipeline defined in ``[eos] pipeline_config_dir`` gets its stream, stop, health, snapshot
and recovery DAGs (``eos_<kind>__<pipeline>``); see airflow_provider_eos.dag_factory."""

from airflow_provider_eos.dag_factory import pipeline_dags

globals().update(pipeline_dags())
