#!/usr/bin/env bash
# Installs what the nested-SVM lane needs (see guest/l1/README.md): Debian's
# bookworm-backports (meson >= 1.5 and python3-pycotap for QEMU 10's build, and QEMU 10's
# ROMs), QEMU's build dependencies, and the tools the L1's initramfs is made with.
set -euo pipefail
SUDO=
[ "$(id -u)" = 0 ] || SUDO=sudo
BPO_SOURCES=/etc/apt/sources.list.d/hvprobe-backports.sources
PACKAGES=(ninja-build libglib2.0-dev libpixman-1-dev libfdt-dev zlib1g-dev pkg-config bzip2 curl libcap-ng-dev libseccomp-dev
          busybox-static cpio xz-utils seabios
          libc6-dev  # hold-vm, a static C program in the L1 initramfs
          kmod)  # depmod: modules.dep of the stock L2 kernel's module tree, for its --modules
# qemu-system-x86: QEMU with KVM inside the L1, beside hvprobe in `hvprobe bench io --qemu`.
BPO_PACKAGES=(meson python3-pycotap qemu-system-data qemu-system-x86)

if ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
    echo "hvprobe-l1: adding bookworm-backports (deb and deb-src) to apt's sources" >&2
    $SUDO tee "$BPO_SOURCES" >/dev/null <<'SOURCES'
Types: deb deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
    $SUDO apt-get update -q
fi

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
missing=() missing_bpo=()
for p in "${PACKAGES[@]}"; do installed "$p" || missing+=("$p"); done
for p in "${BPO_PACKAGES[@]}"; do installed "$p" || missing_bpo+=("$p"); done
# meson from bookworm itself is 1.0, too old for QEMU 10.
if installed meson && ! dpkg --compare-versions "$(dpkg-query -W -f='${Version}' meson)" ge 1.5; then
    missing_bpo+=(meson)
fi
if [ ${#missing[@]} -eq 0 ] && [ ${#missing_bpo[@]} -eq 0 ]; then
    echo "hvprobe-l1: lane dependencies already installed" >&2
    exit 0
fi
$SUDO apt-get update -q
export DEBIAN_FRONTEND=noninteractive
if [ ${#missing[@]} -gt 0 ]; then
    echo "hvprobe-l1: installing ${missing[*]}" >&2
    $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
if [ ${#missing_bpo[@]} -gt 0 ]; then
    echo "hvprobe-l1: installing from bookworm-backports: ${missing_bpo[*]}" >&2
    $SUDO apt-get install -y -q --no-install-recommends -t bookworm-backports "${missing_bpo[@]}"
fi
