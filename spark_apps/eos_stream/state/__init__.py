"""The pipeline's own tables in the meta schema: their DDL, the epoch that fences a driver, the
running lock and stop requests."""
