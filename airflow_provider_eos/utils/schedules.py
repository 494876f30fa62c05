"""Whether Airflow would take a string as a DAG's schedule. Nothing here imports Airflow."""

from __future__ import annotations

# Airflow's schedule presets beyond croniter's own (@hourly, @daily, @weekly, @monthly, @yearly...).
_AIRFLOW_ONLY_PRESETS = {"@once": None, "@continuous": None, "@quarterly": "0 0 1 */3 *"}


def schedule_problem(schedule: str | None) -> str | None:
    """Why Airflow would refuse ``schedule`` as a DAG's schedule, or None."""
    from croniter import croniter

    if schedule is None or (schedule in _AIRFLOW_ONLY_PRESETS and _AIRFLOW_ONLY_PRESETS[schedule] is None):
        return None
    expression = _AIRFLOW_ONLY_PRESETS.get(schedule) or schedule
    if not croniter.is_valid(expression):
        return (f"{schedule!r} is not a cron expression or an Airflow preset "
                "(@hourly, @daily, @weekly, @monthly, @quarterly, @yearly, @once, @continuous)")
    return None
