"""The consumer pipeline, one module per stage:

- `loop`: `Pipeline`, the poll loop and the sources' rebalance listener; it commits offsets to the source
- `intake`: records decoded and fed to the state machine (`RecordIntake`)
- `writer`: resolved units applied to the sinks in order, then confirmed (`SinkWriter`)
- `bad_rows`: a batch's rows that do not type, taken out under the error policy (`BadRowRetry`)
- `resume`: what the sinks record of the group's progress, read back to resume (`RecordedProgress`)
- `stats`: the totals a run returns (`PipelineStats`)
"""

from consumer.pipeline.bad_rows import RowDecoder
from consumer.pipeline.intake import DecodedRecord
from consumer.pipeline.loop import Pipeline
from consumer.pipeline.stats import PipelineStats

__all__ = ["DecodedRecord", "Pipeline", "PipelineStats", "RowDecoder"]
