//! What a run says about its VM at the end, the same after a boot (`hvprobe run`) and a
//! restore (`hvprobe run --snapshot`): the exits it took and the guest's refused writes
//! into hvprobe's code, as lines for the caller to print.

/// The run's exits for its last line: `N exits (I int3, S single-step, D debug-register),
/// E instructions emulated, R guest int3 re-injected`.
pub fn exit_summary(outcome: &hvprobe_vmm::VmOutcome) -> String {
    let mut line = format!(
        "{} exits ({} int3, {} single-step, {} debug-register), {} instructions emulated, {} guest int3 re-injected",
        outcome.exits,
        outcome.breakpoints,
        outcome.single_steps,
        outcome.hardware_breakpoints,
        outcome.instructions_emulated,
        outcome.breakpoints_reinjected
    );
    if outcome.guest_debug_registers_hidden > 0 {
        line.push_str(&format!(
            "; the guest's own debug registers were set while hvprobe's were loaded ({} loads): they did not fire",
            outcome.guest_debug_registers_hidden
        ));
    }
    line
}

/// The line that says the guest wrote into hvprobe's out-of-line code (refused: the code
/// half of the area is a read-only memory slot), when it did. A guest kernel does not do
/// that by accident.
pub fn refused_ool_writes(outcome: &hvprobe_vmm::VmOutcome) -> Option<String> {
    (outcome.ool_writes_refused > 0).then(|| {
        format!(
            "hvprobe: the guest wrote into hvprobe's out-of-line code {} times; refused (the writers' RIP and CR3 \
             are in the log)",
            outcome.ool_writes_refused
        )
    })
}
