"""The exactly-once oracle (``oracle``): what Kafka committed against what the database holds.

    python -m spark_apps.eos_stream.audit --config pipeline.json [--help]
"""
