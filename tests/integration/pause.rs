//! Long host pauses of the bundled guest. The guest keeps time with kvm-clock, so its clock
//! jumps over a pause, and RCU's stall detector takes the jump for a stalled grace period
//! unless each parked vCPU tells the guest that the host paused it (`KVM_KVMCLOCK_CTRL`).
//! The bundled kernel has no soft-lockup detector (`CONFIG_SOFTLOCKUP_DETECTOR` is off):
//! RCU's stall detector is the one that would complain.

use crate::common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hvprobe_arch::Gva;
use hvprobe_introspection::btf::Btf;
use hvprobe_introspection::memory::GuestVirtRead;
use hvprobe_vmm::{ConsoleOutput, NoProbes, StopReason, Vm};

/// What the waiting init reads from its console: `<length>\n<script>`.
fn workload_message(command: &str) -> Vec<u8> {
    let script = format!("{command}\n");
    let mut msg = format!("{}\n", script.len()).into_bytes();
    msg.extend_from_slice(script.as_bytes());
    msg
}

/// The stall timeout at its minimum (3 s), then grace periods wanted again and again
/// until the guest's clock says 7 s have passed, the pause included: each
/// `: </proc/uptime` opens and closes a file, and a closed file is freed through
/// `call_rcu`. Shell built-ins only: a process costs seconds here.
const WORKLOAD: &str = "echo 3 > /sys/module/rcupdate/parameters/rcu_cpu_stall_timeout && \
    read up _ < /proc/uptime && end=$((${up%.*} + 7)) && echo LOOPING && \
    while read up _ < /proc/uptime && [ ${up%.*} -lt $end ]; do \
    : </proc/uptime; : </proc/uptime; : </proc/uptime; : </proc/uptime; done && echo LOOP-DONE";

/// Longer than the stall timeout (3 s), with room to spare.
const PAUSE: Duration = Duration::from_secs(5);

/// The address of `symbol` in the bundled guest's System.map.
fn system_map_address(map: &str, symbol: &str) -> u64 {
    map.lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            let (addr, _, name) = (f.next()?, f.next()?, f.next()?);
            (name == symbol).then(|| u64::from_str_radix(addr, 16).ok())?
        })
        .unwrap_or_else(|| panic!("{symbol} is not in System.map"))
}

#[test]
fn a_long_host_pause_during_a_grace_period_raises_no_rcu_stall_warning() {
    let dir = common::snapshot(2);
    let map = std::fs::read_to_string(common::bundled_guest_dir().join("System.map")).unwrap();

    let mut vm = Vm::restore(&dir, Some(2), ConsoleOutput::Discard, &[]).expect("restore");
    // `rcu_state.gp_seq`: its two low bits are nonzero while a grace period is in progress.
    let state = vm.vcpu_state(0).unwrap();
    let slide = state.lstar.wrapping_sub(system_map_address(&map, "entry_SYSCALL_64"));
    let kernel = hvprobe_live::live_memory(vm.memory(), &state);
    let at = |symbol| Gva(system_map_address(&map, symbol).wrapping_add(slide));
    let btf = Btf::from_guest(&kernel, at("__start_BTF"), at("__stop_BTF")).expect("the guest's BTF");
    let gp_seq = Gva(at("rcu_state").0 + btf.member_offset("rcu_state", "gp_seq").unwrap().offset);
    let grace_period_in_progress = || kernel.read_u64(gp_seq).unwrap() & 3 != 0;

    vm.send_console_input(workload_message(WORKLOAD));
    let console = vm.console_log();
    let control = vm.control();
    let runner = std::thread::spawn(move || vm.run(Arc::new(NoProbes)));
    let deadline = Instant::now() + Duration::from_secs(60);
    while !console.contents().contains("LOOPING") {
        assert!(
            Instant::now() < deadline,
            "the workload did not start\n{}",
            console.tail(20)
        );
        assert!(!runner.is_finished(), "the VM stopped early\n{}", console.tail(20));
        std::thread::sleep(Duration::from_millis(10));
    }

    // Pause while a grace period is in progress: with the guest's clock 5 s further on
    // when it resumes, that grace period looks stalled.
    let deadline = Instant::now() + Duration::from_secs(30);
    let paused = loop {
        assert!(
            Instant::now() < deadline,
            "no grace period started\n{}",
            console.tail(20)
        );
        if grace_period_in_progress() {
            let paused = control.pause_all().unwrap();
            if grace_period_in_progress() {
                break paused;
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    std::thread::sleep(PAUSE);
    drop(paused);

    let deadline = Instant::now() + Duration::from_secs(60);
    while !runner.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    control.stop(StopReason::Stopped);
    let outcome = runner.join().unwrap().unwrap();
    let log = console.contents();
    let stalls: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("rcu: INFO") || l.contains("detected stall") || l.contains("soft lockup"))
        .collect();
    assert!(
        stalls.is_empty(),
        "the guest took the {PAUSE:?} pause for a stall:\n{}",
        stalls.join("\n")
    );
    assert_eq!(outcome.reason, StopReason::GuestExit(0), "{}", console.tail(30));
    assert!(log.contains("LOOP-DONE"), "{}", console.tail(30));
    assert_eq!(
        control.counters.kvmclock_pauses.load(Ordering::Relaxed),
        2,
        "each parked vCPU tells the guest it was paused, once"
    );
}
