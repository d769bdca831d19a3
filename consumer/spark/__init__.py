"""Spark side of the SDK: the configured session, typed DataFrames of changelog batches, readers, the
`ticdc` data source (`source`) and the Spark engine that runs the pipeline on its micro-batches (`engine`)."""
