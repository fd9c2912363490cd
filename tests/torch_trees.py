"""Compare and allocate nested state dicts of tensors, for the client's torch tests."""

from __future__ import annotations

from typing import Any

import torch


def assert_same(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_same(actual[key], value)
        elif isinstance(value, torch.Tensor):
            assert torch.equal(actual[key], value), key
        else:
            assert actual[key] == value, key


def zeros_like(tree: dict[str, Any]) -> dict[str, Any]:
    return {
        k: zeros_like(v) if isinstance(v, dict) else torch.zeros_like(v) for k, v in tree.items()
    }
