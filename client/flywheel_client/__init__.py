"""Python client of the Flywheel platform: `Flywheel(url, key)`, `wrap(openai_client, agent=...)` and the
`flywheel` command line (`flywheel_client.cli`)."""

__version__ = "0.1.0"

from flywheel_client.client import API_MAJOR, Flywheel  # noqa: E402
from flywheel_client.errors import (  # noqa: E402
    ApiError,
    FlywheelError,
    IncompatibleServer,
    ServerUnreachable,
)
from flywheel_client.wrap import wrap  # noqa: E402

__all__ = ["API_MAJOR", "ApiError", "Flywheel", "FlywheelError", "IncompatibleServer", "ServerUnreachable",
           "__version__", "wrap"]
