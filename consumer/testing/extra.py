"""The `testing` extra: the fixtures that run servers (the embedded Kafka broker, the S3 server) need
packages a plain `pip install ticdc-consumer` leaves out. Importing one without them raises this module's
error, which names the install command, instead of a bare ImportError from deep inside a dependency."""

from __future__ import annotations

INSTALL = "pip install 'ticdc-consumer[testing]'"


class MissingExtraError(ImportError):
    """A fixture module was imported without the `testing` extra it needs."""


def missing_extra(module: str, requirement: str) -> MissingExtraError:
    """The error for `module` imported without `requirement`, one of the `testing` extra's packages."""
    return MissingExtraError(f"{module} needs {requirement}, from the testing extra: {INSTALL}")
