#!/usr/bin/env bash
# Builds virtiofsd (crates.io, pinned) into hvprobe's cache, for `hvprobe run --rootfs /
# --rwdir` (virtio-fs) and for the nested lane (guest/l1/build.sh), and prints the
# binary's path on stdout:
#   ${HVPROBE_CACHE:-$HOME/.cache/hvprobe}/virtiofsd-VERSION/bin/virtiofsd
# Warm, it only checks. Needs cargo (rustup's) and a C toolchain (virtiofsd links libcap-ng
# and libseccomp: guest/install-deps.sh installs their -dev packages).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=cache.sh
. "$here/cache.sh"
cache_stdout_is_the_result
VIRTIOFSD_VERSION=1.14.0
dest="$hvprobe_cache/virtiofsd-$VIRTIOFSD_VERSION"
virtiofsd="$dest/bin/virtiofsd"
if [ ! -x "$virtiofsd" ]; then
    cache_lock "$hvprobe_cache/virtiofsd.lock" 8 "virtiofsd"
    if [ ! -x "$virtiofsd" ]; then
        echo "hvprobe: building virtiofsd $VIRTIOFSD_VERSION (crates.io; a few minutes, once)" >&2
        rm -rf "$dest.tmp"
        cargo install virtiofsd --version "=$VIRTIOFSD_VERSION" --locked --quiet \
            --root "$dest.tmp" --target-dir "$hvprobe_cache/virtiofsd-target"
        rm -rf "$hvprobe_cache/virtiofsd-target"
        cache_publish "$dest.tmp" "$dest"
    fi
fi
cache_result "$virtiofsd"
