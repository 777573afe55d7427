#!/usr/bin/env bash
# The storm: host probes and return probes with fetch-args on twenty-two of the bundled
# guest's hottest functions (scheduler, allocator, locks, timers, page faults, VFS), on two
# vCPUs, while the guest forks, reads and sleeps for a while. Passes when the guest logs no
# oops, warning, BUG or stall and none of its processes dies of a fault (segfault, trap),
# the host's count of a probe equals the guest's own kprobe event over the same window
# (taken half-way, under load), and the kernel text hashes the same after the probes are
# removed as after a run without them.
#
#   bench/storm.sh [SECONDS] [OPTIMIZE]   (default 600 and auto; CI runs a short one of
#                                         each: `auto` traps every return probe's call on
#                                         kvm_pvm, `on` makes them exit-free)
#
# Prints a summary (duration, hits, oopses, window counts, text hashes) and exits 0/1.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-600}
optimize=${2:-auto}
cpus=2
hvprobe=${HVPROBE:-./target/release/hvprobe}
[ -n "${HVPROBE:-}" ] || cargo build --release --locked -q
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The snapshot the tests use: hvprobe's cached one, made by one boot if missing.
snap=$("$hvprobe" snapshot create --cached --cpus "$cpus" | tail -n 1)
[ -f "$snap/state" ] || { echo "storm: no snapshot ($snap)" >&2; exit 1; }

cat > "$work/storm.probes" <<'PROBES'
# scheduler
p:storm/schedule schedule comm=$comm
p:storm/ttwu try_to_wake_up p=%di state=%si:u32
p:storm/wake_new wake_up_new_task p=%di
# allocator
r:storm/cache_alloc kmem_cache_alloc ret=$retval
p:storm/cache_free kmem_cache_free s=%di obj=%si
p:storm/kmalloc __kmalloc size=%di:u64 flags=%si:x32
p:storm/kfree kfree obj=%di
r:storm/alloc_pages __alloc_pages ret=$retval
# locks
p:storm/mutex_lock mutex_lock lock=%di
p:storm/mutex_unlock mutex_unlock lock=%di
# timers
p:storm/hrtimer_start hrtimer_start_range_ns timer=%di mode=%cx:u32
p:storm/tick update_process_times user=%di:u32
# the timer interrupt's path (the bundled guest has no high-resolution timers), stepped
# out of line: the fence at lapic_next_deadline+5 is one of the instructions after which
# kvm_pvm loses the step's trap
p:storm/next_deadline lapic_next_deadline+5
p:storm/apic_timer __sysvec_apic_timer_interrupt
# page faults
r:storm/mm_fault handle_mm_fault ret=$retval
p:storm/mm_fault_entry handle_mm_fault addr=%si flags=%dx:x32
# VFS
p:storm/vfs_read vfs_read file=%di count=%dx:u64
r:storm/vfs_read_ret vfs_read ret=$retval
p:storm/openat2 do_sys_openat2 dfd=%di:s32 name=+0(%si):ustring
p:storm/filp_close filp_close file=%di
# processes
r:storm/copy_process copy_process ret=$retval
p:storm/exit do_exit code=%di
# the window's oracle: the guest puts its own kprobe event here too
p:storm/getppid __x64_sys_getppid di=%di
PROBES

# Forks, reads and sleeps until the guest's uptime passes the end; half-way, on vCPU 1,
# the guest's own kprobe event on getppid counts a loop that the host's probe counts too.
workload="T=/sys/kernel/tracing; echo 'p:gk __x64_sys_getppid' > \$T/kprobe_events
read -r up rest < /proc/uptime; start=\${up%.*}; end=\$((start + $seconds))
( sleep $((seconds / 2)); echo 1 > \$T/events/kprobes/gk/enable; taskset -c 1 hvprobe-loop 200
  echo 0 > \$T/events/kprobes/gk/enable; while read -r l; do echo \"PROFILE \$l\"; done < \$T/kprobe_profile ) &
window=\$!
i=0
while :; do
  read -r up rest < /proc/uptime; up=\${up%.*}; [ \$up -ge \$end ] && break
  /bin/true &
  for j in 1 2 3 4 5 6 7 8; do read -r l < /proc/version; done
  sleep 1
  wait \$!
  i=\$((i + 1))
done
wait \$window
echo \"STORM iterations=\$i\"
dmesg > /tmp/dmesg; n=0; while read -r l; do case \$l in *Oops*|*WARNING*|*BUG:*|*'rcu: INFO'*|*stall*|*'soft lockup'*|*'general protection'*|*'segfault at'*|*'traps:'*) echo \"GUEST-LOG \$l\"; n=\$((n + 1));; esac; done < /tmp/dmesg
echo \"STORM guest-problems=\$n\""

started=$(date +%s)
set +e
"$hvprobe" run --snapshot "$snap" --cpus "$cpus" --workload "$workload" --probes "$work/storm.probes" --text-hash \
    --optimize "$optimize" > "$work/out" 2> "$work/err"
status=$?
set -e
elapsed=$(( $(date +%s) - started ))
"$hvprobe" run --snapshot "$snap" --cpus "$cpus" --workload 'true' --text-hash > /dev/null 2> "$work/err-plain" || true

hash_probes=$(grep -oE 'kernel text sha256 [0-9a-f]+' "$work/err" | awk '{print $4}' || true)
hash_plain=$(grep -oE 'kernel text sha256 [0-9a-f]+' "$work/err-plain" | awk '{print $4}' || true)
guest_window=$(grep -E '^PROFILE +gk ' "$work/out" | awk '{print $3}' || true)
host_getppid=$(grep -cE 'hvprobe-loop-[0-9]+ .* getppid: ' "$work/out" || true)
problems=$(grep -oE 'STORM guest-problems=[0-9]+' "$work/out" | cut -d= -f2 || true)
iterations=$(grep -oE 'STORM iterations=[0-9]+' "$work/out" | cut -d= -f2 || true)
summary=$(grep -E '^hvprobe: (probe hits|probes gone)' "$work/err" || true)

echo "storm: ${seconds} s of guest time asked (--optimize $optimize), ${elapsed} s wall, exit status $status, ${iterations:-?} workload iterations"
echo "${summary:-storm: no summary line}" | sed "s/^/storm: /"
echo "storm: guest problems logged: ${problems:-?}"
grep -E '^GUEST-LOG' "$work/out" || true
echo "storm: window on getppid: guest's own kprobe event ${guest_window:-?} hits, host probe ${host_getppid:-?} hits"
echo "storm: kernel text sha256 after the probes ${hash_probes:-?}, without probes ${hash_plain:-?}"
{ grep -E '^[0-9a-f]{16}  [kr]  ' "$work/err" || true; } | sed 's/^/storm:   /'

fail=0
[ "$status" = 0 ] || { echo "storm: FAIL: hvprobe exited $status"; tail -n 30 "$work/out" "$work/err" | grep -v "^PROFILE"; fail=1; }
[ "${problems:-x}" = 0 ] || { echo "storm: FAIL: the guest logged problems"; fail=1; }
[ -n "$guest_window" ] && [ "$guest_window" = "$host_getppid" ] || { echo "storm: FAIL: window counts differ"; fail=1; }
[ -n "$hash_probes" ] && [ "$hash_probes" = "$hash_plain" ] || { echo "storm: FAIL: kernel text differs"; fail=1; }
[ "$fail" = 0 ] && echo "storm: PASS"
exit "$fail"
