"""The provider's metrics: :mod:`.scheme` makes their names and values from the reports its
tasks already produce (docs/metrics.md), :mod:`.sender` sends them through Airflow's Stats."""
