"""Exactly-once Kafka -> Spark -> PostgreSQL pipelines, operated from Apache Airflow."""

__version__ = "0.1.0"
