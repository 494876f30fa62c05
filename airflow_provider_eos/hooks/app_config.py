"""The one call that turns a pipeline's definition into the app's complete config: the
definition's fields, a run's fields, and what the pipeline's connections say (Kafka's bootstrap
servers and security options, the database and its password), validated once.

Every operator that runs or touches a pipeline gets its config here, and nothing fills it in
later: the launchers write its JSON (``PipelineConfig.to_json``: no secret) for the app, and put
its secrets (the password, the Kafka options) into the app's environment only."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from airflow_provider_eos.hooks.eos_postgres import EosPostgresHook
from airflow_provider_eos.hooks.kafka_connection import kafka_client_settings

if TYPE_CHECKING:
    from airflow_provider_eos.utils.pipeline_definition import PipelineDefinition
    from spark_apps.eos_stream.run.config import PipelineConfig


def complete_app_config(definition: PipelineDefinition, *, kafka_config_id: str,
                        postgres: EosPostgresHook | str, kafka_options: Mapping[str, str] | None = None,
                        **run: Any) -> PipelineConfig:
    """The app's validated config for ``definition`` with its connections filled in.

    :param kafka_config_id: the Kafka connection: ``bootstrap.servers`` and its security options.
    :param postgres: the target database's hook, or its connection id: where the app writes, and the password.
    :param kafka_options: Kafka client options over the connection's own (librdkafka names).
    :param run: the app's run fields (``run_seconds``, ``stop_poll_seconds``, ``ignore_stop_request``)
        and the app fields a run sets for itself (a replay's ``engine``, ``trigger``, ``checkpoint_dir``).
    :raises spark_apps.eos_stream.run.config_rules.ConfigError: the config breaks a rule of the app.
    """
    pg = EosPostgresHook(postgres_conn_id=postgres, meta_schema=definition.meta_schema) \
        if isinstance(postgres, str) else postgres
    kafka = kafka_client_settings(kafka_config_id)
    return definition.app_pipeline_config(
        kafka_bootstrap=kafka.bootstrap, kafka_options={**kafka.security, **(kafka_options or {})},
        postgres={**pg.app_target(), "password": pg.app_password()}, **run).validate()


def connections_filled_in(config: PipelineConfig, *, kafka_config_id: str | None,
                          postgres: EosPostgresHook) -> PipelineConfig:
    """A deprecated step's app config (``pipeline_config``: a dict or a JSON file, already read) with
    the connections filled in as :func:`complete_app_config` fills them, as a new config: Kafka
    from ``kafka_config_id`` when given (its security options under the config's own), else the
    config's own bootstrap servers; the database always from ``postgres``."""
    from spark_apps.eos_stream.run.config import PostgresTarget

    kafka: dict[str, Any] = {}
    if kafka_config_id:
        settings = kafka_client_settings(kafka_config_id)
        kafka = {"kafka_bootstrap": settings.bootstrap, "kafka_options": {**settings.security, **config.kafka_options}}
    target = PostgresTarget(**postgres.app_target(), password=postgres.app_password())
    return replace(config, postgres=target, **kafka)
