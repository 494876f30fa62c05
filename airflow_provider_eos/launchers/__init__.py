"""How the provider runs an engine: one protocol (``protocol.AppLauncher``: start, events, stop,
result) and one implementation per way of running it, chosen by ``choose.launcher_for``:
spark-submit (``spark_submit``), a child process (``child_process``: the continuous engine) and
this process (``in_process``: the direct replay). Nothing that is not Spark passes through a
Spark hook. This package's ``__init__`` imports nothing, so the hook may import ``result``."""
