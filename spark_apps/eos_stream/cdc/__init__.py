"""Change data capture: Debezium change events mirrored into PostgreSQL tables (docs/cdc.md)."""
