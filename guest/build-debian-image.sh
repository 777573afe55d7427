#!/usr/bin/env bash
# Builds a Debian userland disk image for the tests: `debootstrap --variant=minbase` of
# Debian 12 into a directory, then `mkfs.ext4 -d` of that directory into a sparse raw
# image (no loop mount). Cached under ${HVPROBE_CACHE:-~/.cache/hvprobe}/debian-image/KEY,
# KEY from this script, the suite, the mirror and debootstrap's version; prints the
# image's path on stdout. Needs root (debootstrap unpacks packages as their owners) and
# the Debian mirror of /etc/apt (apt-get works, so it does).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=cache.sh
. "$here/cache.sh"
cache_stdout_is_the_result
SUITE=bookworm
MIRROR=${HVPROBE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# A minbase system takes ~200 MB; the rest is room for what the tests write.
IMAGE_MIB=512
log() { echo "hvprobe-debian-image: $*" >&2; }

for tool in debootstrap mkfs.ext4; do
    command -v "$tool" >/dev/null || { log "error: $tool is missing (guest/install-deps.sh installs it)"; exit 1; }
done
key=$( { sha256sum <"$0"; echo "$SUITE $MIRROR $IMAGE_MIB"; dpkg-query -W -f='${Version}' debootstrap; } \
       | sha256sum | cut -c1-16)
dir="$hvprobe_cache/debian-image/$key"
image="$dir/rootfs.img"
if [ -f "$image" ]; then
    cache_result "$image"
    exit 0
fi
cache_lock "$hvprobe_cache/debian-image/.lock" 9 "the Debian image"
if [ -f "$image" ]; then
    cache_result "$image"
    exit 0
fi
[ "$(id -u)" = 0 ] || { log "error: debootstrap needs root to build the image"; exit 1; }

tmp="$dir.tmp"
rm -rf "$tmp"
mkdir -p "$tmp"
log "debootstrap --variant=minbase $SUITE from $MIRROR (a few minutes, once)"
debootstrap --variant=minbase "$SUITE" "$tmp/root" "$MIRROR" >"$tmp/debootstrap.log" 2>&1 || {
    tail -20 "$tmp/debootstrap.log" >&2
    log "error: debootstrap failed; its log: $tmp/debootstrap.log"
    exit 1
}
# The downloaded packages are not part of the system.
rm -rf "$tmp/root/var/cache/apt/archives/"*.deb
echo hvprobe-debian >"$tmp/root/etc/hostname"
mkfs.ext4 -q -F -L hvprobe-debian -d "$tmp/root" "$tmp/rootfs.img" "${IMAGE_MIB}M"
rm -rf "$tmp/root"
mv "$tmp/debootstrap.log" "$tmp/build.log"
cache_publish "$tmp" "$dir"
log "built $image"
cache_result "$image"
