"""The exactly-once streaming app: Kafka (read_committed) -> Spark -> PostgreSQL.

Imports nothing from Airflow: it runs under spark-submit anywhere Spark runs.
"""
