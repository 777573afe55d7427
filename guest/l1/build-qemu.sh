#!/usr/bin/env bash
# Builds the lane's QEMU: Debian's QEMU 10.2.2 source with qemu-svm-int3-intercept.patch,
# x86_64-softmmu only (TCG, and vhost-user for virtio-fs: the L1 mounts the host's files
# through virtiofsd), installed
# under ~/.cache/hvprobe/l1/qemu-KEY. KEY hashes the source tarball, the patch, the
# configure flags and this script, so a change to any of them rebuilds and a warm run does
# nothing. Prints the installed qemu-system-x86_64's path on stdout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../cache.sh
. "$here/../cache.sh"
cache_stdout_is_the_result
cache="$hvprobe_cache/l1"
QEMU_VERSION=10.2.2
TARBALL="qemu_${QEMU_VERSION}+ds.orig.tar.xz"
TARBALL_URL="http://deb.debian.org/debian/pool/main/q/qemu/qemu_${QEMU_VERSION}%2bds.orig.tar.xz"
TARBALL_SHA256=be05230fe47a6937cd29f28f562932c8125f9c93c2a82c625198f7a4aa601dfb
PATCH="$here/qemu-svm-int3-intercept.patch"
# Debian's python3: meson and pycotap are installed for it, not for a pyenv on PATH.
CONFIGURE_FLAGS=(--python=/usr/bin/python3 --target-list=x86_64-softmmu --without-default-features --enable-tcg
                 --enable-vhost-user --enable-fdt=system --disable-docs
                 --disable-werror --disable-install-blobs)

key=$( { echo "$TARBALL_SHA256"; cat "$PATCH" "$0"; echo "${CONFIGURE_FLAGS[*]}"; } \
       | sha256sum | cut -c1-16)
prefix="$cache/qemu-$key"
if [ -x "$prefix/bin/qemu-system-x86_64" ]; then
    cache_result "$prefix/bin/qemu-system-x86_64"
    exit 0
fi
cache_lock "$cache/.qemu.lock" 8 "the lane's QEMU"
if [ -x "$prefix/bin/qemu-system-x86_64" ]; then
    cache_result "$prefix/bin/qemu-system-x86_64"
    exit 0
fi

log() { echo "hvprobe-l1: $*" >&2; }
mkdir -p "$cache/dl"
if ! echo "$TARBALL_SHA256  $cache/dl/$TARBALL" | sha256sum -c --quiet >/dev/null 2>&1; then
    log "downloading $TARBALL_URL"
    curl -sSfL -o "$cache/dl/$TARBALL.part" "$TARBALL_URL"
    echo "$TARBALL_SHA256  $cache/dl/$TARBALL.part" | sha256sum -c --quiet \
        || { log "$TARBALL: checksum mismatch"; exit 1; }
    cache_publish "$cache/dl/$TARBALL.part" "$cache/dl/$TARBALL"
fi

work=$(mktemp -d "$cache/qemu-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
log "building patched QEMU $QEMU_VERSION (x86_64-softmmu; ~7 min on 2 cores) in $work"
tar -C "$work" -xJf "$cache/dl/$TARBALL"
src="$work/qemu-$QEMU_VERSION"
patch -d "$src" -p1 --quiet < "$PATCH"
# The +ds tarball drops the edk2 firmware blobs; meson would try to unpack them whenever
# bzip2 is installed. The lane boots with SeaBIOS from Debian's packages instead.
sed -i 's/unpack_edk2_blobs = bzip2.found()/unpack_edk2_blobs = false/' "$src/meson.build"
# It drops the prebuilt device trees of other machines too; without dtc meson would install
# the missing files. The lane boots no machine that needs one.
sed -i '/install_data(dtbs, /d' "$src/pc-bios/dtb/meson.build"
mkdir "$src/build"
rm -rf "$prefix.tmp"
(cd "$src/build" && ../configure --prefix="$prefix.tmp" "${CONFIGURE_FLAGS[@]}" >"$work/configure.log" 2>&1) \
    || { tail -40 "$work/configure.log" >&2; log "QEMU configure failed"; exit 1; }
ninja -C "$src/build" -j"$(nproc)" >"$work/build.log" 2>&1 \
    || { tail -40 "$work/build.log" >&2; log "QEMU build failed"; exit 1; }
ninja -C "$src/build" install >"$work/install.log" 2>&1 \
    || { tail -20 "$work/install.log" >&2; log "QEMU install failed"; exit 1; }
cache_publish "$prefix.tmp" "$prefix"
log "QEMU built: $prefix"
cache_result "$prefix/bin/qemu-system-x86_64"
