#!/usr/bin/env bash
# Here, before a lent machine's run (scripts/device_cores.sh): the daemon's packages that
# machine's image lacks or holds in other versions, as CPython 3.12 x86-64 wheels in ./.whl
# (ignored by git; `carry` takes it there, where nothing can be fetched). Each at the
# version this checkout's .venv was tested with; --no-deps, so every one is named here.
set -euo pipefail
cd "$(dirname "$0")/.."
names=(grpcio grpcio-health-checking protobuf inotify-simple uvloop google-crc32c blake3
       prometheus-client cryptography cffi pycparser bitmath python-json-logger tqdm pyyaml)
rm -rf .whl && mkdir .whl
for name in "${names[@]}"; do
  version=$(.venv/bin/python -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$version" ] || { echo "device_wheels: $name is not in .venv (make venv first)" >&2; exit 1; }
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl "$name==$version" \
    || python3 -m pip download -q --no-deps --no-binary=:none: -d .whl "$name==$version"
done
du -sh .whl
