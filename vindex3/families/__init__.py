"""Model families known at the import boundary. Importing this package registers them."""

from . import decoder  # noqa: F401
from . import granitemoehybrid, mamba2  # noqa: F401,E402
