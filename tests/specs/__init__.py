"""Pipeline specs that exist only for tests (loaded by reference, e.g. ``tests.specs.readings:READINGS``)."""
