"""The options every `mtc` command that reads the bucket shares: whose signatures to check
(``--tls-ca``, ``--tls-server-name``, ``--accept-unsigned-records``) and how long one
request may take (``--storage-timeout``), each with the daemon's environment variable."""

from __future__ import annotations

import argparse
import os

from mtc_replicator.core import argtypes
from mtc_replicator.core.retry import DEFAULT_STORAGE_TIMEOUT
from mtc_replicator.transport.tls import DEFAULT_SERVER_NAME


def add_bucket_options(c: argparse.ArgumentParser, *, checks: str, unsigned: str) -> None:
    """Add them to ``c``; ``checks`` says what ``--tls-ca`` checks, ``unsigned`` what
    ``--accept-unsigned-records`` lets through."""
    c.add_argument(
        "--tls-ca",
        default=os.environ.get("MTC_TLS_CA") or None,
        help=f"the nodes' CA (PEM): {checks} [MTC_TLS_CA] "
        "(default: none, signatures are not checked)",
    )
    c.add_argument(
        "--tls-server-name",
        default=os.environ.get("MTC_TLS_SERVER_NAME", DEFAULT_SERVER_NAME),
        help="the DNS name in node certificates [MTC_TLS_SERVER_NAME] (default: %(default)s)",
    )
    c.add_argument(
        "--accept-unsigned-records",
        action="store_true",
        help=f"with --tls-ca: {unsigned}",
    )
    c.add_argument(
        "--storage-timeout",
        type=argtypes.storage_timeout,
        default=os.environ.get("MTC_STORAGE_TIMEOUT", str(DEFAULT_STORAGE_TIMEOUT)),
        metavar="SECONDS",
        help="the most seconds one request to the bucket may take, its retries included "
        "(default: %(default)s) [MTC_STORAGE_TIMEOUT]",
    )
