"""A pipeline's records: the spec that describes them, their parsing, the staging lines a batch
COPYs and the aggregate deltas its records add up to."""
