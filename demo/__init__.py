"""The main job: the whole exactly-once story on the embedded local stack,
driven through Airflow's REST API against its real scheduler and triggerer."""
