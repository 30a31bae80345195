"""User-facing errors. The CLI turns these into one-line messages and exit code 1 (2 for usage)."""


class CagkvError(Exception):
    """Base class of every error cagkv reports to a user."""


class UsageError(CagkvError):
    """Bad input from the user: a missing path, an empty question, an unknown model name."""


class ModelNotFoundError(UsageError):
    """A model name that is neither in the zoo, nor a local folder, nor reachable."""


class StoreError(CagkvError):
    """The store is unusable: unwritable, made with another canonical model, corrupt."""


class CorruptBlobError(StoreError):
    """A stored cache whose bytes do not match its checksum or hold invalid numbers."""


class TranslatorError(CagkvError):
    """A translator artifact that is missing, malformed or made for other models."""


class ModelPullError(CagkvError):
    """A zoo model that cannot be fetched, fails its checksum, or cannot be converted."""
