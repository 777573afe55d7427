#!/usr/bin/env bash
# Build hvprobe's bundled default guest: a tiny Linux 6.1 kernel (Debian's
# linux-source-6.1 + config.fragment + the one compatibility patch) and an
# uncompressed initramfs (hvprobe-init as /init, busybox-static, workloads).
#
# The LAST line of stdout is the absolute path of the artefact directory:
#   ${HVPROBE_CACHE:-$HOME/.cache/hvprobe}/guest/<key>/
#     vmlinux bzImage System.map config initramfs.cpio cmdline .complete
# Progress goes to stderr; make output goes to <cache>/guest/build.log.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SELF="$HERE/$(basename "${BASH_SOURCE[0]}")"
CACHE=${HVPROBE_CACHE:-$HOME/.cache/hvprobe}
GUEST_CACHE="$CACHE/guest"
SRC_TARBALL=/usr/src/linux-source-6.1.tar.xz
BUSYBOX=/bin/busybox

log() { echo "hvprobe-guest: $*" >&2; }
die() { echo "hvprobe-guest: error: $*" >&2; exit 1; }

# ---- inputs and key --------------------------------------------------------
FRAGMENT="$HERE/kernel/config.fragment"
CMDLINE_SRC="$HERE/kernel/cmdline"
shopt -s nullglob
PATCHES=("$HERE"/kernel/patches/*.patch)
INIT_SRCS=("$HERE"/init/*.c "$HERE"/init/*.h "$HERE"/init/profile)
WORKLOADS=("$HERE"/workloads/*.c)
MODULE_SRCS=("$HERE"/modules/*.c "$HERE"/modules/Kbuild)
shopt -u nullglob
[ -f "$FRAGMENT" ] || die "missing $FRAGMENT"
[ -f "$CMDLINE_SRC" ] || die "missing $CMDLINE_SRC"
[ -f "$HERE/init/hvprobe-init.c" ] || die "missing $HERE/init/hvprobe-init.c"

pkgver() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || true; }

key_material() {
    local f
    for f in "$SELF" "$FRAGMENT" "$CMDLINE_SRC" "${PATCHES[@]}" "${INIT_SRCS[@]}" "${WORKLOADS[@]}" "${MODULE_SRCS[@]}"; do
        printf '%s\n' "${f#"$HERE"/}"
        sha256sum <"$f"
    done
    echo "linux-source-6.1 $(pkgver linux-source-6.1)"
    echo "busybox-static $(pkgver busybox-static)"
    echo "gcc $(gcc -dumpfullversion 2>/dev/null || echo none) $(pkgver gcc)"
    echo "musl-tools $(pkgver musl-tools)"
    # pahole turns the DWARF into the kernel's BTF: another version, other BTF.
    echo "dwarves $(pkgver dwarves) $(pahole --version 2>/dev/null || echo none)"
}

# The warm path must be fast and need nothing but coreutils + dpkg-query.
KEY=$(key_material | sha256sum | cut -c1-16)
OUT="$GUEST_CACHE/$KEY"
if [ -e "$OUT/.complete" ]; then
    echo "$OUT"
    exit 0
fi

# ---- tool check -----------------------------------------------------------
missing=()
need_cmd() { command -v "$1" >/dev/null 2>&1 || missing+=("$2"); }
need_file() { [ -e "$1" ] || missing+=("$2"); }
need_cmd gcc gcc
need_cmd musl-gcc musl-tools
need_cmd make make
need_cmd flex flex
need_cmd bison bison
need_cmd bc bc
need_cmd perl perl
need_cmd patch patch
need_cmd xz xz-utils
need_cmd lz4 lz4
need_cmd cpio cpio
need_cmd pahole dwarves
need_cmd objcopy binutils
need_cmd flock util-linux
need_cmd dpkg-query dpkg
need_file /usr/include/gelf.h libelf-dev
need_file /usr/include/openssl/opensslv.h libssl-dev
need_file /usr/lib/x86_64-linux-gnu/libc.a libc6-dev
need_file "$SRC_TARBALL" linux-source-6.1
need_file "$BUSYBOX" busybox-static
if [ ${#missing[@]} -gt 0 ]; then
    mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
    die "missing build requirements; install the Debian packages: apt-get install ${missing[*]}"
fi
if ! [ "$(pkgver busybox-static)" ] || LC_ALL=C ldd "$BUSYBOX" >/dev/null 2>&1; then
    die "$BUSYBOX is not the static busybox; install the Debian package busybox-static"
fi

mkdir -p "$GUEST_CACHE"
LOG="$GUEST_CACHE/build.log"

# ---- lock (one builder at a time; the others wait and then reuse) ----------
exec 9>"$GUEST_CACHE/.lock"
if ! flock -n 9; then
    log "another build is running; waiting for $GUEST_CACHE/.lock"
    flock 9
fi
if [ -e "$OUT/.complete" ]; then
    echo "$OUT"
    exit 0
fi

TMP=$(mktemp -d "$GUEST_CACHE/.tmp-$KEY.XXXXXX")
cleanup() { rm -rf "$TMP"; }
trap cleanup EXIT
: >"$LOG"

run() { # run a noisy command, output to the build log
    echo "+ $*" >>"$LOG"
    if ! "$@" >>"$LOG" 2>&1; then
        log "FAILED: $*"
        tail -n 40 "$LOG" >&2
        die "build failed; full log: $LOG"
    fi
}

JOBS=$(nproc)
export KBUILD_BUILD_USER=hvprobe KBUILD_BUILD_HOST=hvprobe
export KBUILD_BUILD_TIMESTAMP="2024-01-01 00:00:00 UTC"

# ---- kernel source: extracted + patched once per (package version, patches) -
SRCVER=$(pkgver linux-source-6.1)
PATCHKEY=$(cat /dev/null "${PATCHES[@]}" | sha256sum | cut -c1-12)
SRCDIR="$CACHE/src/linux-source-6.1_${SRCVER}_$PATCHKEY"
if [ ! -e "$SRCDIR/.complete" ]; then
    log "extracting $SRC_TARBALL ($SRCVER)"
    rm -rf "$SRCDIR" "$SRCDIR.tmp"
    mkdir -p "$SRCDIR.tmp"
    run tar -xf "$SRC_TARBALL" -C "$SRCDIR.tmp" --strip-components=1
    for p in "${PATCHES[@]}"; do
        log "applying $(basename "$p")"
        echo "+ patch -p1 --dry-run < $p" >>"$LOG"
        if ! patch -p1 -d "$SRCDIR.tmp" --dry-run --batch <"$p" >>"$LOG" 2>&1; then
            tail -n 20 "$LOG" >&2
            die "patch $p does not apply cleanly to linux-source-6.1 $SRCVER; log: $LOG"
        fi
        out=$(patch -p1 -d "$SRCDIR.tmp" --batch --forward <"$p" 2>&1) || {
            echo "$out" >>"$LOG"
            die "patch $p failed; log: $LOG"
        }
        echo "$out" >>"$LOG"
        if grep -qiE 'fuzz|reject' <<<"$out"; then
            die "patch $p applied only with fuzz; refresh it against $SRCVER; log: $LOG"
        fi
        if grep -qiE 'offset' <<<"$out"; then
            log "note: $(basename "$p") applied at an offset (harmless; refresh when convenient)"
        fi
    done
    touch "$SRCDIR.tmp/.complete"
    mv "$SRCDIR.tmp" "$SRCDIR"
fi

# ---- kernel build (out of tree; the object dir is reused between keys) -----
OBJ="$CACHE/obj/linux-source-6.1_${SRCVER}_$PATCHKEY"
mkdir -p "$OBJ"
KMAKE=(make -C "$SRCDIR" O="$OBJ" ARCH=x86_64 -j"$JOBS")

log "configuring (tinyconfig + $(basename "$FRAGMENT"))"
run "${KMAKE[@]}" tinyconfig
run "$SRCDIR/scripts/kconfig/merge_config.sh" -m -O "$OBJ" "$OBJ/.config" "$FRAGMENT"
run "${KMAKE[@]}" olddefconfig

# Verify that every option of the fragment survived olddefconfig.
bad=()
while IFS= read -r line; do
    case "$line" in
    CONFIG_*=*)
        sym=${line%%=*}
        if ! grep -qxF -- "$line" "$OBJ/.config"; then
            got=$(grep -E "^(# )?$sym[= ]" "$OBJ/.config" || echo "$sym absent")
            bad+=("wanted '$line', got '$got'")
        fi
        ;;
    "# CONFIG_"*" is not set")
        sym=${line#\# }
        sym=${sym%% *}
        if got=$(grep -E "^$sym=" "$OBJ/.config"); then
            bad+=("wanted '$line', got '$got'")
        fi
        ;;
    esac
done <"$FRAGMENT"
if [ ${#bad[@]} -gt 0 ]; then
    printf 'hvprobe-guest:   %s\n' "${bad[@]}" >&2
    die "${#bad[@]} option(s) of $FRAGMENT did not survive olddefconfig (unmet Kconfig dependencies?)"
fi

log "building kernel (make -j$JOBS; log: $LOG)"
run "${KMAKE[@]}" vmlinux bzImage
grep -q '^CONFIG_PVH=y' "$OBJ/.config" || die "CONFIG_PVH missing"
if command -v readelf >/dev/null 2>&1; then
    readelf -n "$OBJ/vmlinux" | grep -q 'Xen' || die "vmlinux has no PVH (Xen) ELF note"
fi

# CONFIG_DEBUG_INFO_BTF: the host reads struct layouts from .BTF (also loaded in guest
# memory between __start_BTF and __stop_BTF).
readelf -SW "$OBJ/vmlinux" | grep -F ' .BTF ' >/dev/null || die "vmlinux has no .BTF section (CONFIG_DEBUG_INFO_BTF)"
grep -q ' __start_BTF$' "$OBJ/System.map" || die "System.map has no __start_BTF"

mkdir -p "$TMP/out"
# The DWARF is ~5x the rest of vmlinux, and only source-line probes read it (perf
# probe's FUNC:LINE, variables by name): it goes to its own file, vmlinux.debug, which
# nothing that boots or restores the guest opens. --strip-debug keeps .BTF, the symbol
# table and the PVH note in the vmlinux that boots.
run objcopy --strip-debug "$OBJ/vmlinux" "$TMP/out/vmlinux"
run objcopy --only-keep-debug "$OBJ/vmlinux" "$TMP/out/vmlinux.debug"
cp "$OBJ/arch/x86/boot/bzImage" "$TMP/out/bzImage"
cp "$OBJ/System.map" "$TMP/out/System.map"
cp "$OBJ/.config" "$TMP/out/config"

# ---- the test module (guest/modules): out of tree, against this kernel -------------
# `make modules` writes the Module.symvers an external module links against (the
# configuration builds no module of its own). The initramfs gets it without DWARF; the
# artefact directory keeps it whole (hvprobe_test.ko) for tools that read its DWARF.
log "building the test module"
run "${KMAKE[@]}" modules
cp -r "$HERE/modules" "$TMP/modules"
run "${KMAKE[@]}" M="$TMP/modules" modules
cp "$TMP/modules/hvprobe_test.ko" "$TMP/out/hvprobe_test.ko"
run objcopy --strip-debug "$TMP/modules/hvprobe_test.ko" "$TMP/bin-hvprobe_test.ko"

# ---- user space ----------------------------------------------------------------
log "building /init and workloads"
mkdir -p "$TMP/bin"
# musl, not glibc: a static glibc /init is ~750 KB, and every initramfs byte costs
# boot time on kvm_pvm (unpacking runs emulated, ~3 s per MB).
run musl-gcc -static -Os -Wall -Wextra -o "$TMP/bin/hvprobe-init" "$HERE/init/hvprobe-init.c"
run strip "$TMP/bin/hvprobe-init"
WL_NAMES=()
for w in "${WORKLOADS[@]}"; do
    n=$(basename "$w" .c)
    # per-file flags: a line `// hvprobe-cflags: ...` (default: -static -O2)
    cflags=$(sed -n 's|^// hvprobe-cflags:||p' "$w" | head -n1)
    # shellcheck disable=SC2086
    run musl-gcc ${cflags:--static -O2} -Wall -Wextra -o "$TMP/bin/$n" "$w"
    run strip "$TMP/bin/$n"
    WL_NAMES+=("$n")
done

# gen_init_cpio (built by the kernel build) writes an uncompressed newc
# archive from a text list: no root needed for device nodes, reproducible.
GEN="$OBJ/usr/gen_init_cpio"
[ -x "$GEN" ] || run "${KMAKE[@]}" usr/gen_init_cpio
LIST="$TMP/initramfs.list"
{
    for d in /bin /sbin /usr /usr/bin /usr/sbin /usr/lib /usr/lib/hvprobe /dev /proc /sys /tmp /root /etc /hvprobe; do
        echo "dir $d 0755 0 0"
    done
    echo "nod /dev/console 0600 0 0 c 5 1"
    echo "nod /dev/null 0666 0 0 c 1 3"
    echo "nod /dev/port 0600 0 0 c 1 4"
    echo "nod /dev/ttyS0 0600 0 0 c 4 64"
    echo "file /init $TMP/bin/hvprobe-init 0755 0 0"
    echo "file /bin/busybox $BUSYBOX 0755 0 0"
    # Only /bin/sh links to busybox: Debian's busybox-static runs its applets from
    # the shell without symlinks (FEATURE_SH_STANDALONE/PREFER_APPLETS), and each
    # initramfs entry costs the emulated kernel ~0.1 s to create on kvm_pvm (the
    # 268 applet links took 26 s of boot). `busybox APPLET` reaches every applet.
    echo "slink /bin/sh /bin/busybox 0777 0 0"
    # The power commands must end the VM (see hvprobe-init.c).
    for a in poweroff halt reboot; do
        echo "slink /sbin/$a /init 0777 0 0"
    done
    for n in "${WL_NAMES[@]}"; do
        echo "file /usr/bin/$n $TMP/bin/$n 0755 0 0"
    done
    echo "file /usr/lib/hvprobe/hvprobe_test.ko $TMP/bin-hvprobe_test.ko 0644 0 0"
    echo "file /etc/profile $HERE/init/profile 0644 0 0"
    echo "file /etc/passwd $TMP/passwd 0644 0 0"
    echo "file /etc/group $TMP/group 0644 0 0"
} >"$LIST"
printf 'root:x:0:0:root:/root:/bin/sh\n' >"$TMP/passwd"
printf 'root:x:0:\n' >"$TMP/group"
# shellcheck disable=SC2016
echo "+ $GEN -t 0 $LIST" >>"$LOG"
"$GEN" -t 0 "$LIST" >"$TMP/out/initramfs.cpio" 2>>"$LOG" || die "gen_init_cpio failed; log: $LOG"

# Single-line command line from the commented source file.
grep -v '^[[:space:]]*#' "$CMDLINE_SRC" | tr -s ' \t\n' '   ' | sed 's/^ *//; s/ *$//' >"$TMP/out/cmdline"
echo >>"$TMP/out/cmdline"

touch "$TMP/out/.complete"
rm -rf "$OUT"
mv "$TMP/out" "$OUT"
log "done: vmlinux $(stat -c %s "$OUT/vmlinux") B, bzImage $(stat -c %s "$OUT/bzImage") B, initramfs $(stat -c %s "$OUT/initramfs.cpio") B"
echo "$OUT"
