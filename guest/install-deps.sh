#!/usr/bin/env bash
# Installs the Debian packages the bundled guest's build needs (guest/build.sh checks
# for them and names any that are missing).
set -euo pipefail
PACKAGES=(linux-source-6.1 busybox-static gcc musl-tools make flex bison bc perl patch xz-utils lz4 cpio
          util-linux libelf-dev libssl-dev libc6-dev dwarves binutils
          e2fsprogs debootstrap   # mkfs.ext4 -d, debugfs, debootstrap: the disk tests' images
          libcap-ng-dev libseccomp-dev pkg-config   # virtiofsd's build (guest/build-virtiofsd.sh)
          acpica-tools   # iasl: the VMM's ACPI tables checked by ACPICA's disassembler
          python3)       # tests/integration/shares.rs: the host's own python3 and sqlite3 under --rootfs /
SUDO=
[ "$(id -u)" = 0 ] || SUDO=sudo
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "hvprobe: guest build dependencies already installed" >&2
    exit 0
fi
echo "hvprobe: installing ${missing[*]}" >&2
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
