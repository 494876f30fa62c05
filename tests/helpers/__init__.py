"""Test helpers (child-process producers, Kafka topic utilities)."""
