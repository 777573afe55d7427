//! `hvprobe list functions`: the kernel's traceable functions, offline.

use std::io::Write as _;
use std::process::ExitCode;

use hvprobe_functions::AvailableFunctions;
use hvprobe_probes::spec::wildcard_matches;
use hvprobe_session::guest::BundledGuest;

use super::CliResult;
use crate::cli::ListFunctionsArgs;

/// `hvprobe list functions [GLOB]`.
pub fn functions(args: ListFunctionsArgs) -> CliResult {
    let vmlinux = match args.vmlinux {
        Some(path) => path,
        None => BundledGuest::ensure_built()?.vmlinux,
    };
    let available = AvailableFunctions::from_vmlinux_file(&vmlinux)?;
    let mut out = std::io::stdout().lock();
    let mut listed = 0usize;
    for function in available.all() {
        if args
            .glob
            .as_deref()
            .is_some_and(|g| !wildcard_matches(g, &function.name))
        {
            continue;
        }
        listed += 1;
        let written = if args.addresses {
            writeln!(out, "{:x} {}", function.site.0, function.name)
        } else {
            writeln!(out, "{}", function.name)
        };
        if written.is_err() {
            // A closed pipe (`| head`): the listing is done.
            return Ok(ExitCode::SUCCESS);
        }
    }
    if listed == 0 {
        if let Some(glob) = &args.glob {
            eprintln!("hvprobe: error: no traceable function matches {glob:?}");
            return Ok(ExitCode::FAILURE);
        }
    }
    Ok(ExitCode::SUCCESS)
}
