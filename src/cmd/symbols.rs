//! `hvprobe symbols`: kernel symbols resolved offline, from a vmlinux or a System.map, at
//! link-time addresses.

use std::process::ExitCode;

use hvprobe_introspection::symbols::SymbolTable;

use crate::cli::SymbolsArgs;
use crate::cmd::CliResult;

/// `hvprobe symbols`.
pub fn symbols(args: SymbolsArgs) -> CliResult {
    let table = match &args.system_map {
        Some(map) => SymbolTable::from_system_map_file(map)?,
        None => SymbolTable::from_elf_file(&args.vmlinux)?,
    };
    let mut failed = false;
    for name in &args.names {
        if let Some(hex) = name.strip_prefix("0x") {
            let addr = u64::from_str_radix(hex, 16).map_err(|e| format!("{name}: not a hex address: {e}"))?;
            match table.describe(hvprobe_arch::Gva(addr)) {
                Some(d) => println!("{name} = {d} ({})", table.source()),
                None => {
                    eprintln!("hvprobe: error: {name} is below every symbol");
                    failed = true;
                }
            }
            continue;
        }
        match table.resolve(name) {
            Ok(r) => println!("{name} = {:#x} ({})", r.addr.0, table.source()),
            Err(e) => {
                eprintln!("hvprobe: error: {e}");
                failed = true;
            }
        }
    }
    Ok(if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}
