"""The error every sampling check raises (its own module so that all of them can import it)."""

from __future__ import annotations


class SamplingError(ValueError):
    """A sampling request the sampler refuses; the message names the field."""
