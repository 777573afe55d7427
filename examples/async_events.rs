//! A host-side tool on the async API: restore a snapshot of a guest, put a kprobe on a
//! kernel function, and count its hits per guest task in a tokio task while the guest runs.
//!
//! ```text
//! cargo run --example async_events -- SNAPSHOT_DIR FUNCTION 'WORKLOAD'
//! cargo run --example async_events -- "$(hvprobe snapshot create --cached)" __x64_sys_getppid 'hvprobe-loop 50'
//! ```
//!
//! `hvprobe snapshot create --cached` prints the bundled guest's cached snapshot (made on
//! first use): `~/.cache/hvprobe/snapshots/<key>-1cpu-v3-pvm` on kvm_pvm, `…-hardware` on
//! hardware KVM.

use std::collections::BTreeMap;
use std::sync::Arc;

use hvprobe::guest::workload_message;
use hvprobe_live::{build_tracer, live_memory, load_symbols, ProbeHandler, SymbolsFrom, TaskContext};
use hvprobe_probes::engine::{EventSink, HitEvent, KprobeRequest, ProbePoint};
use hvprobe_vmm::{ConsoleOutput, Vm};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, dir, function, workload] = args.as_slice() else {
        return Err("usage: async_events SNAPSHOT_DIR FUNCTION 'WORKLOAD'".into());
    };
    let mut vm = Vm::restore(std::path::Path::new(dir), None, ConsoleOutput::Stdout, &[])?;
    let state = vm.vcpu_state(0)?;
    let memory = live_memory(vm.memory(), &state);
    let symbols = load_symbols(&SymbolsFrom::Kallsyms, &memory, state.lstar)?.table;
    let tasks = TaskContext::read(&memory, &symbols).ok();

    // A slow consumer never stalls a vCPU: what does not fit counts as nmissed.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<HitEvent>(4096);
    let sink: Arc<dyn EventSink> = Arc::new(tx);
    let tracer = build_tracer(vm.control(), vm.memory(), &state, &symbols, Some(sink))?;
    let point = ProbePoint::Symbol {
        name: function.clone(),
        offset: 0,
    };
    tracer.register(KprobeRequest::event(point, "example", "hit", Vec::new()))?;
    let handler = ProbeHandler::new(&vm);
    handler.attach(tracer.clone(), tasks);
    vm.send_console_input(workload_message(workload));

    let consumer = tokio::spawn(async move {
        let mut per_task = BTreeMap::new();
        while let Some(event) = rx.recv().await {
            *per_task
                .entry(format!("{}-{}", event.record.comm, event.record.pid))
                .or_insert(0u64) += 1;
        }
        per_task
    });
    let outcome = tokio::task::spawn_blocking(move || vm.run(handler)).await??;
    let listing = tracer.listing();
    tracer.unregister_all()?;
    drop(tracer); // the last sender: the consumer's loop ends
    for (task, hits) in consumer.await? {
        println!("{task:>24} {hits}");
    }
    for entry in listing {
        println!("{}", hvprobe_probes::output::listing_line(&entry));
    }
    println!("{}", outcome.reason);
    Ok(())
}
