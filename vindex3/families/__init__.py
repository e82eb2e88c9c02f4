"""Model families known at the import boundary. Importing this package registers them."""

from . import decoder  # noqa: F401
