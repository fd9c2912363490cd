#!/usr/bin/env bash
# Builds the test bed for tests/controller: kube-apiserver 1.20.2 from Debian bookworm's
# source package (built with Debian's Go 1.19) and etcd from Debian's etcd-server. No
# prebuilt Kubernetes binary can be downloaded here (see docs/deploy.md, "The controller's
# tests"), so this builds it ONCE into a cache outside the repository that survives a fresh
# clone: $MTC_K8S_CACHE (default ~/.cache/mtc-replicator/k8s-1.20.2), with the unpacked tree
# and Go's build cache (Kubernetes' build keeps it in _output/local/go/cache) beside it.
# A no-op when the cached binaries exist. Needs root (apt-get) the first time.
#
#   scripts/k8s_testbed.sh            build what is missing, print the bin directory
#   MTC_K8S_WHAT="cmd/kube-apiserver cmd/kube-controller-manager" scripts/k8s_testbed.sh
#
# Exit status 0 with the binaries in place; otherwise non-zero with the reason on stderr
# and in $CACHE/FAILED (tests/controller skips with that reason).
set -euo pipefail

CACHE="${MTC_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mtc-replicator/k8s-1.20.2}"
WHAT="${MTC_K8S_WHAT:-cmd/kube-apiserver cmd/kube-controller-manager}"
BIN="$CACHE/bin"
GO=/usr/lib/go-1.19/bin
SRC_TARBALL=kubernetes_1.20.5+really1.20.2.orig.tar.gz

missing() {
    local target
    for target in $WHAT; do
        [ -x "$BIN/$(basename "$target")" ] || return 0
    done
    command -v etcd >/dev/null || return 0
    return 1
}

if ! missing; then
    echo "$BIN"
    exit 0
fi

mkdir -p "$CACHE"
# One build at a time: a second caller waits for the first and then finds the binaries.
exec 9>"$CACHE/.lock"
flock 9
if ! missing; then
    echo "$BIN"
    exit 0
fi

fail() {
    echo "k8s_testbed: $*" | tee "$CACHE/FAILED" >&2
    exit 1
}
rm -f "$CACHE/FAILED"
start=$(date +%s)

need_apt=()
[ -x "$GO/go" ] || need_apt+=(golang-1.19-go)
[ -d /usr/share/gocode/src/github.com/modern-go/reflect2 ] \
    || need_apt+=(golang-github-modern-go-reflect2-dev)
command -v rsync >/dev/null || need_apt+=(rsync)
command -v etcd >/dev/null || need_apt+=(etcd-server)
src_list=/etc/apt/sources.list.d/mtc-debian-src.sources
have_src=no
ls "$CACHE"/$SRC_TARBALL >/dev/null 2>&1 && have_src=yes
if [ "${#need_apt[@]}" -gt 0 ] || [ "$have_src" = no ]; then
    [ "$(id -u)" = 0 ] || fail "needs root once to apt-get install ${need_apt[*]} and the kubernetes source package"
    if [ ! -e "$src_list" ] && ! grep -rqs '^Types: *deb-src' /etc/apt/sources.list.d/; then
        cat >"$src_list" <<'EOF'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    fi
    apt-get update -qq || fail "apt-get update failed"
    if [ "${#need_apt[@]}" -gt 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null \
            || fail "apt-get install ${need_apt[*]} failed"
    fi
    if [ "$have_src" = no ]; then
        (cd "$CACHE" && apt-get source --download-only -qq kubernetes >/dev/null) \
            || fail "apt-get source --download-only kubernetes failed (is a deb-src entry for bookworm main reachable?)"
    fi
fi
# etcd-server's unit would start a system etcd on 2379; the tests start their own.
if command -v systemctl >/dev/null && systemctl is-active -q etcd 2>/dev/null; then
    systemctl disable --now etcd >/dev/null 2>&1 || true
fi

tree="$CACHE/src/kubernetes-1.20.2"
if [ ! -d "$tree" ]; then
    rm -rf "$CACHE/src" && mkdir -p "$CACHE/src"
    tar -xzf "$CACHE"/$SRC_TARBALL -C "$CACHE/src" || fail "cannot unpack $SRC_TARBALL"
    # The vendored reflect2 v1.0.1 crashes on Go >= 1.18; Debian's 1.0.2 does not.
    reflect2="$tree/vendor/github.com/modern-go/reflect2"
    rm -f "$reflect2"/*.go "$reflect2"/*.s
    cp /usr/share/gocode/src/github.com/modern-go/reflect2/*.go \
        /usr/share/gocode/src/github.com/modern-go/reflect2/*.s "$reflect2"/ 2>/dev/null \
        || cp /usr/share/gocode/src/github.com/modern-go/reflect2/*.go "$reflect2"/
    rm -f "$reflect2"/*_test.go
fi

echo "k8s_testbed: building $WHAT (once; cached in $CACHE)" >&2
(
    cd "$tree"
    export PATH="$GO:$PATH" GOPROXY=off GOFLAGS=-mod=vendor
    # nice: the build shares the machine with whatever else runs.
    nice -n 10 make WHAT="$WHAT" GOLDFLAGS="-s -w" >"$CACHE/build.log" 2>&1
) || fail "make WHAT=$WHAT failed; see $CACHE/build.log"
mkdir -p "$BIN"
for target in $WHAT; do
    name=$(basename "$target")
    cp "$tree/_output/bin/$name" "$BIN/$name.tmp" && mv "$BIN/$name.tmp" "$BIN/$name"
done
echo "k8s_testbed: built $WHAT in $(($(date +%s) - start)) s" | tee -a "$CACHE/build-times" >&2
echo "$BIN"
