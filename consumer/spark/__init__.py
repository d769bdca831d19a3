"""Spark side of the SDK: the configured session, typed DataFrames of changelog batches, readers."""
