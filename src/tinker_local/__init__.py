"""tinker-local: the Tinker training API served on your own hardware."""

__version__ = "0.1.0"

__all__ = ["ServiceClient", "__version__"]


def __getattr__(name: str):
    # Imported lazily: `import tinker_local` stays cheap (no tinker SDK, no torch).
    if name == "ServiceClient":
        from tinker_local.apps.embedded import ServiceClient

        return ServiceClient
    raise AttributeError(f"module 'tinker_local' has no attribute {name!r}")
