"""Interoperability helpers: drive real third-party checkpoint clients against the daemon."""
