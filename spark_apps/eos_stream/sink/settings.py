"""What a sink is set to: the pipeline's third shape, after its definition and the app's config.

A driver builds it once from the app's ``PipelineConfig`` (``SinkSettings.of``) when it has
claimed the pipeline; ``BatchSink`` takes it with the connections and callbacks of the run,
which are the run's resources, not settings. The config's own fields are validated where the
config is built (``run/config_rules``); what is checked here is what only the sink's settings
can break.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from spark_apps.eos_stream.records.spec import PipelineSpec
from spark_apps.eos_stream.sink.modes import DeliveryMode


class SinkConfig(Protocol):
    """The fields of the app's ``PipelineConfig`` (run/config.py) that a sink reads. A
    protocol, so the sink never imports the run package above it."""

    pipeline: str
    target_schema: str
    meta_schema: str
    max_batch_attempts: int
    transient_retry_seconds: float


@dataclass(frozen=True)
class SinkSettings:
    """One pipeline's sink.

    :param spec: what the records are and which targets they go to.
    :param mode: the delivery mode (``modes.MODES``).
    :param pipeline: the name that keys offsets, dead letters and locks.
    :param target_schema: schema of the target tables.
    :param meta_schema: schema of the bookkeeping tables.
    :param max_batch_attempts: counted data failures of one batch before it is isolated.
    :param epoch: the pipeline epoch the driver got when it started
        (``fencing.bump_epoch``); every batch proves it is still current.
        None skips the ownership check (tests of the apply path alone).
    :param transient_retry_seconds: how long one batch is retried in the
        driver after transient errors before the run fails (0: never retried).
    :param prepared_parts: batches may arrive written as prepared parts
        (``WrittenParts``, P1-P6); needs ``epoch``.
    """

    spec: PipelineSpec
    mode: DeliveryMode
    pipeline: str
    target_schema: str
    meta_schema: str
    max_batch_attempts: int
    epoch: int | None = None
    transient_retry_seconds: float = 300.0
    prepared_parts: bool = False

    def __post_init__(self) -> None:
        if self.prepared_parts and self.epoch is None:
            raise ValueError("prepared parts are decided under the pipeline's epoch: give the sink an epoch")

    @classmethod
    def of(cls, config: SinkConfig, spec: PipelineSpec, mode: DeliveryMode, *, epoch: int | None,
           prepared_parts: bool = False) -> SinkSettings:
        """The settings of a driver that claimed ``config``'s pipeline at ``epoch``."""
        return cls(spec=spec, mode=mode, pipeline=config.pipeline, target_schema=config.target_schema,
                   meta_schema=config.meta_schema, max_batch_attempts=config.max_batch_attempts, epoch=epoch,
                   transient_retry_seconds=config.transient_retry_seconds, prepared_parts=prepared_parts)
