//! Embeds the bundled guest's build inputs (the workspace's guest/build.sh and what it
//! reads: the kernel config fragment, command line and patches, the init and workload
//! sources) in the library, and so in the `hvprobe` binary, so that an installed or copied
//! `hvprobe` builds its guest without a checkout.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The inputs, relative to guest/: files, and directories taken whole.
const INPUTS: &[&str] = &[
    "build.sh",
    "kernel",
    "init",
    "workloads",
    "modules",
    // virtiofsd's build, for shared directories, and the cache protocol it follows.
    "build-virtiofsd.sh",
    "cache.sh",
];

fn main() {
    // The workspace's guest/, beside this crate.
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let guest = manifest.parent().expect("the crate is in the workspace").join("guest");
    let mut files = Vec::new();
    for input in INPUTS {
        collect(&guest, &guest.join(input), &mut files);
    }
    files.sort();
    let mut table = String::from("/// The bundled guest's build inputs: (path under guest/, contents).\npub const GUEST_INPUTS: &[(&str, &[u8])] = &[\n");
    for (relative, absolute) in &files {
        writeln!(table, "    ({relative:?}, include_bytes!({absolute:?})),").unwrap();
    }
    table.push_str("];\n");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("guest_inputs.rs");
    std::fs::write(&out, table).unwrap_or_else(|e| panic!("cannot write {}: {e}", out.display()));
}

/// Every file under `path` (or `path` itself), as (path relative to `guest`, absolute
/// path); cargo reruns this script when any of them, or a directory's listing, changes.
fn collect(guest: &Path, path: &Path, files: &mut Vec<(String, String)>) {
    println!("cargo:rerun-if-changed={}", path.display());
    if path.is_dir() {
        let entries = std::fs::read_dir(path).unwrap_or_else(|e| panic!("cannot list {}: {e}", path.display()));
        for entry in entries {
            collect(guest, &entry.expect("a directory entry").path(), files);
        }
    } else {
        let relative = path
            .strip_prefix(guest)
            .expect("under guest/")
            .to_string_lossy()
            .into_owned();
        files.push((relative, path.to_string_lossy().into_owned()));
    }
}
