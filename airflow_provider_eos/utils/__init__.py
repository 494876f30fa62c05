"""Pure logic of the provider: no Airflow imports, unit-tested on its own."""
