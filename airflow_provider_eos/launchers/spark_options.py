"""Spark properties the stream operator's spark-submit sets by default, and which masters are
local; here, importing nothing, so that the benchmarks and the tests start their drivers as the
operator does."""


def is_local_master(master: str) -> bool:
    """A master whose driver runs on this machine with its executors (``local``, ``local[N]``,
    ``local-cluster[...]``)."""
    return master == "local" or master.startswith("local[") or master.startswith("local-cluster")


# The driver JVM's options on a local master (``spark.driver.defaultJavaOptions``, which a user's
# own setting replaces and ``spark.driver.extraJavaOptions`` extends). There the driver JVM is the
# whole of Spark, sharing the cores with the Python workers, PostgreSQL and the broker, while the
# records never pass through it (the tasks read Kafka in Python): C2's compiler threads spend more
# CPU than its code saves, and a serial collector needs no threads of its own
# (docs/benchmarks.md, "The driver JVM on a local master"). A cluster's driver keeps the JVM's defaults.
LOCAL_DRIVER_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
