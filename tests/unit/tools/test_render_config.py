"""``tools.render_config``: the order its sections are checked in, the YAML envelope, and
the bounds on seconds (the field-by-field errors and the CRD's schema are
``tests/deploy/test_render_config.py``, which needs the CRD)."""

from __future__ import annotations

from typing import Any

import pytest

from mtc_replicator.core.pacing import MAX_YIELD_TO_SAVES
from mtc_replicator.tools import render_config
from mtc_replicator.tools.render_config import RenderError, load, parse


def cr(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "apiVersion": render_config.API_VERSION,
        "kind": render_config.KIND,
        "metadata": {"name": "default"},
        "spec": {"backupUrl": "gs://ckpt-bucket/mtc", "inMemoryVolumeSize": "50Gi"},
    }
    base["spec"].update(spec)
    return base


def test_a_minimal_configuration_takes_every_default() -> None:
    c = parse(cr())
    assert (c.name, c.namespace, c.backup_url, c.ram_size) == (
        "default",
        render_config.DEFAULT_NAMESPACE,
        "gs://ckpt-bucket/mtc",
        "50Gi",
    )
    assert c.tolerations == render_config.DEFAULT_TOLERATIONS
    assert (c.tls, c.cert_manager, c.tls_secret) == (True, False, render_config.DEFAULT_TLS_SECRET)
    assert (c.max_transfer_rate, c.yield_to_saves_seconds, c.drain_seconds) == (None, None, None)
    assert c.keep_steps is None
    assert c.registry_url is None
    assert c.credentials_secret is None


@pytest.mark.parametrize(
    ("spec", "first"),
    [
        ({"backupUrl": "http://x", "tls": []}, "spec.backupUrl"),
        ({"inMemoryVolumeSize": "0Gi", "nodeSelector": []}, "spec.inMemoryVolumeSize"),
        ({"registryUrl": "gs://", "s3": {}}, "spec.registryUrl"),
        ({"tolerations": {}, "s3": {"region": "x"}}, "spec.tolerations"),
        ({"tls": {"enabled": 1}, "drainSeconds": -1}, "spec.tls.enabled"),
        ({"maxTransferRate": "fast", "drainSeconds": -1}, "spec.maxTransferRate"),
        ({"drainSeconds": -1, "allowedNamespaces": "ml"}, "spec.drainSeconds"),
        ({"allowedServiceAccounts": ["x"], "logLevel": "TRACE"}, "spec.allowedServiceAccounts[0]"),
    ],
)
def test_the_first_bad_section_is_named(spec: dict[str, Any], first: str) -> None:
    with pytest.raises(RenderError) as caught:
        parse(cr(**spec))
    assert caught.value.field == first


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        ("yieldToSavesSeconds", MAX_YIELD_TO_SAVES + 1, f"{MAX_YIELD_TO_SAVES:g}"),
        ("drainSeconds", render_config.MAX_DRAIN_SECONDS + 0.5, "600"),
    ],
)
def test_seconds_name_their_bound(key: str, value: float, shown: str) -> None:
    with pytest.raises(RenderError, match=f"from 0 to {shown}, got {value!r}"):
        parse(cr(**{key: value}))


def test_seconds_at_the_bounds_are_taken() -> None:
    c = parse(cr(yieldToSavesSeconds=0, drainSeconds=render_config.MAX_DRAIN_SECONDS))
    assert (c.yield_to_saves_seconds, c.drain_seconds) == (0, render_config.MAX_DRAIN_SECONDS)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected one YAML document, found 0"),
        ("a: 1\n---\nb: 2\n", "expected one YAML document, found 2"),
        ("a: [", "not valid YAML"),
        ("- a\n", "expected a mapping, got list"),
    ],
)
def test_load_takes_one_mapping(text: str, message: str) -> None:
    with pytest.raises(RenderError, match=message) as caught:
        load(text)
    assert caught.value.field == "(document)"
