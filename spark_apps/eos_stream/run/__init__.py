"""One run of a pipeline: its config, the preflight, the driver's claim on the target, the Spark
stream and the Spark-less replay, and their progress."""
