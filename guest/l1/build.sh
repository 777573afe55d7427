#!/usr/bin/env bash
# Builds the nested-SVM lane under ~/.cache/hvprobe/l1, each part keyed by its inputs:
#   - QEMU 10.2.2 with qemu-svm-int3-intercept.patch (build-qemu.sh);
#   - virtiofsd (crates.io, pinned; ../build-virtiofsd.sh), which shares the host's files
#     with the L1;
#   - the L1 kernel, Debian's linux-image-cloud-amd64 from the suite
#     HVPROBE_L1_KERNEL_SUITE names (default bookworm-backports: 6.12; under bookworm's
#     6.1 the L2 stopped or triple-faulted in ~4 % of runs, docs/known-issues.md),
#     and an initramfs of busybox, this directory's init, hold-vm and the modules it loads
#     (kvm_amd, virtio-fs, overlay; those the kernel has built in are skipped, compressed
#     ones unpacked);
#   - the stock kernel the lane boots as an L2 (HVPROBE_L2_STOCK_KERNEL), the same
#     package from the suite HVPROBE_L2_KERNEL_SUITE names (default: apt's candidate), so
#     that the L1's kernel can change without changing what the stock-kernel jobs test;
#     with its whole module tree (with depmod's modules.dep), for `hvprobe run --modules`
#     (HVPROBE_L2_STOCK_MODULES). One download when both are the same.
# Writes lane.env (the parts' paths) and prints its path on stdout. Warm, it only checks.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../cache.sh
. "$here/../cache.sh"
cache_stdout_is_the_result
cache="$hvprobe_cache/l1"
KERNEL_PACKAGE=linux-image-cloud-amd64
# The modules the L1's init loads, dependencies first.
MODULES=(virt/lib/irqbypass.ko arch/x86/kvm/kvm.ko arch/x86/kvm/kvm-amd.ko
         drivers/virtio/virtio_ring.ko drivers/virtio/virtio.ko
         drivers/virtio/virtio_pci_modern_dev.ko drivers/virtio/virtio_pci_legacy_dev.ko
         drivers/virtio/virtio_pci.ko fs/fuse/fuse.ko fs/fuse/virtiofs.ko
         fs/overlayfs/overlay.ko)
log() { echo "hvprobe-l1: $*" >&2; }
# One builder of the lane at a time (build-qemu.sh takes a lock of its own); a second
# waits, then finds the parts built.
cache_lock "$cache/.lock" 9 "the lane"

qemu=$("$here/build-qemu.sh")

# The one build of virtiofsd, shared with `hvprobe run --rootfs/--rwdir` (its own lock).
virtiofsd=$("$here/../build-virtiofsd.sh")

# fetch_kernel SUITE: downloads (once) the kernel package $KERNEL_PACKAGE points at now in
# SUITE (empty: apt's candidate) and sets kernel_dir, kernel_release and kernel_label.
fetch_kernel() {
    local apt_suite=() image_package image_version work tree m
    [ -n "$1" ] && apt_suite=(-t "$1")
    # The kernel package the metapackage points at now, and its version: the kernel's key.
    # (apt-cache fails for a suite apt does not know: the message below says so.)
    image_package=$( { apt-cache "${apt_suite[@]}" depends "$KERNEL_PACKAGE" 2>/dev/null || true; } \
        | sed -n 's/^ *Depends: \(linux-image-[^ ]*\)$/\1/p' | head -1)
    [ -n "$image_package" ] || { log "apt knows no $KERNEL_PACKAGE ${apt_suite[*]} (run guest/l1/install-deps.sh)"; exit 1; }
    image_version=$( { apt-cache "${apt_suite[@]}" policy "$image_package" 2>/dev/null || true; } \
        | sed -n 's/^ *Candidate: //p')
    [ -n "$image_version" ] && [ "$image_version" != "(none)" ] \
        || { log "apt has no candidate of $image_package ${apt_suite[*]} (apt-get update?)"; exit 1; }
    kernel_release=${image_package#linux-image-}
    kernel_label="$image_package $image_version"
    # v2: with the module tree.
    kernel_dir="$cache/kernel-v2-${image_package}_$image_version"
    [ -f "$kernel_dir/vmlinuz" ] && return
    command -v depmod >/dev/null || { log "depmod is missing (install kmod: guest/l1/install-deps.sh)"; exit 1; }
    log "downloading $image_package $image_version"
    work=$(mktemp -d "$cache/kernel.XXXXXX")
    (cd "$work" && apt-get download -q "$image_package=$image_version" >/dev/null 2>&1) \
        || { rm -rf "$work"; log "apt-get download $image_package=$image_version failed (apt-get update?)"; exit 1; }
    dpkg-deb -x "$work"/*.deb "$work/root"
    mkdir -p "$work/out"
    cp "$work/root/boot/vmlinuz-$kernel_release" "$work/out/vmlinuz"
    cp "$work/root/boot/System.map-$kernel_release" "$work/out/System.map"
    cp "$work/root/boot/config-$kernel_release" "$work/out/config"
    mkdir -p "$work/out/modules"
    tree="$work/root/lib/modules/$kernel_release"
    for m in "${MODULES[@]}"; do
        if [ -f "$tree/kernel/$m" ]; then
            cp "$tree/kernel/$m" "$work/out/modules/"
        elif [ -f "$tree/kernel/$m.xz" ]; then
            xz -dc "$tree/kernel/$m.xz" > "$work/out/modules/$(basename "$m")"
        elif ! grep -qx "kernel/$m" "$tree/modules.builtin"; then
            rm -rf "$work"; log "$image_package has no module $m, nor has it built in"; exit 1
        fi
    done
    # The package leaves modules.dep to its postinst's depmod.
    depmod -b "$work/root" "$kernel_release"
    mkdir -p "$work/out/lib/modules"
    mv "$work/root/lib/modules/$kernel_release" "$work/out/lib/modules/$kernel_release"
    echo "$image_version" > "$work/out/version"
    cache_publish "$work/out" "$kernel_dir"
    rm -rf "$work"
}

fetch_kernel "${HVPROBE_L2_KERNEL_SUITE:-}"
l2_dir=$kernel_dir l2_release=$kernel_release l2_label=$kernel_label
fetch_kernel "${HVPROBE_L1_KERNEL_SUITE:-bookworm-backports}"

initramfs_key=$( { cat "$here/init" "$here/log" "$here/hold-vm.c" "$0" /bin/busybox; echo "$kernel_dir"; } | sha256sum | cut -c1-16)
initramfs="$cache/initramfs-$initramfs_key.cpio"
if [ ! -f "$initramfs" ]; then
    log "building the L1 initramfs"
    work=$(mktemp -d "$cache/initramfs.XXXXXX")
    mkdir -p "$work"/{bin,dev,proc,sys,modules}
    cp /bin/busybox "$work/bin/busybox"
    ln -s busybox "$work/bin/sh"
    install -m 0755 "$here/init" "$work/init"
    install -m 0755 "$here/log" "$work/log"
    gcc -static -Os -Wall -Werror -o "$work/bin/hold-vm" "$here/hold-vm.c" \
        || { rm -rf "$work"; log "building hold-vm (gcc -static) failed"; exit 1; }
    cp "$kernel_dir"/modules/*.ko "$work/modules/"
    for m in "${MODULES[@]}"; do
        if [ -f "$kernel_dir/modules/$(basename "$m")" ]; then basename "$m"; fi
    done > "$work/modules.order"
    (cd "$work" && find . | sort | cpio --quiet -o -H newc -R 0:0) > "$initramfs.tmp"
    cache_publish "$initramfs.tmp" "$initramfs"
    rm -rf "$work"
fi

cache_write_file "$cache/lane.env" <<ENV
HVPROBE_L1_QEMU=$qemu
HVPROBE_L1_VIRTIOFSD=$virtiofsd
HVPROBE_L1_KERNEL=$kernel_dir/vmlinuz
HVPROBE_L1_KERNEL_VERSION="$kernel_label"
HVPROBE_L1_INITRAMFS=$initramfs
HVPROBE_L2_STOCK_KERNEL=$l2_dir/vmlinuz
HVPROBE_L2_STOCK_KERNEL_VERSION="$l2_label"
HVPROBE_L2_STOCK_MODULES=$l2_dir/lib/modules/$l2_release
ENV
cache_result "$cache/lane.env"
