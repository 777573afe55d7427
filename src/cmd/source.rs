//! `hvprobe lines` and `hvprobe vars`: what perf probe's `-L` and `-V` show, from the
//! kernel's DWARF.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use hvprobe_introspection::dwarf::path_ends_with;
use hvprobe_probes::spec::source::KernelSource;
use hvprobe_probes::spec::{parse_line, ProbeSpec, SourcePoint, Target};
use hvprobe_session::guest::BundledGuest;
use hvprobe_session::kernel_source::KernelSourceFiles;

use super::CliResult;
use crate::cli::{DwarfArgs, LinesArgs, VarsArgs};

/// The kernel's DWARF as the flags name it, the bundled guest's by default.
fn kernel_source(args: &DwarfArgs) -> Result<KernelSourceFiles, Box<dyn std::error::Error>> {
    let (vmlinux, debuginfo) = match (&args.vmlinux, &args.debuginfo) {
        (Some(v), d) => (v.clone(), d.clone().unwrap_or_else(|| v.clone())),
        (None, d) => {
            let guest = BundledGuest::ensure_built()?;
            (guest.vmlinux, d.clone().unwrap_or(guest.debuginfo))
        }
    };
    for file in [&vmlinux, &debuginfo] {
        std::fs::metadata(file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    }
    for file in &args.module_debuginfo {
        std::fs::metadata(file).map_err(|e| format!("--module-debuginfo {}: {e}", file.display()))?;
    }
    let files = match (&args.vmlinux, &args.debuginfo) {
        (None, None) => KernelSourceFiles::bundled(),
        _ => KernelSourceFiles::new(vmlinux, debuginfo),
    };
    Ok(files.with_modules(args.module_debuginfo.clone()))
}

/// The kernel's source, or module `module`'s.
fn source_of<'f>(
    files: &'f KernelSourceFiles,
    module: Option<&str>,
) -> Result<&'f KernelSource, Box<dyn std::error::Error>> {
    Ok(match module {
        Some(m) => files.get_module(m)?,
        None => files.get()?,
    })
}

/// A source target as a spec line's target parses it (`FUNC` alone: its entry).
fn source_point(text: &str) -> Result<SourcePoint, Box<dyn std::error::Error>> {
    let spec = parse_line(&format!("p {text}")).map_err(|e| format!("{text}: {}", e.kind))?;
    match spec {
        Some(ProbeSpec::Kprobe {
            target: Target::Source(point),
            ..
        }) => Ok(point),
        Some(ProbeSpec::Kprobe {
            target: Target::Symbol { name, offset: 0 },
            ..
        }) if !hvprobe_probes::spec::is_wildcard_pattern(&name) => Ok(SourcePoint {
            function: Some(name),
            file: None,
            line: None,
            module: None,
        }),
        Some(ProbeSpec::Kprobe {
            target:
                Target::ModuleSymbol {
                    module,
                    name,
                    offset: 0,
                },
            ..
        }) => Ok(SourcePoint {
            function: Some(name),
            file: None,
            line: None,
            module: Some(module),
        }),
        _ => Err(format!(
            "{text}: not a source target ([MOD:]FUNC, [MOD:]FUNC:N, [MOD:]FUNC@FILE[:N] or [MOD:]FILE:LINE)"
        )
        .into()),
    }
}

pub fn lines(args: LinesArgs) -> CliResult {
    let files = kernel_source(&args.dwarf)?;
    // `MOD:FUNC`: a module's function (a `:` before any `@`).
    let (module, function) = match args.function.split_once(':') {
        Some((m, f)) if !m.contains('@') => (Some(m), f),
        _ => (None, args.function.as_str()),
    };
    let kernel = source_of(&files, module)?;
    let (name, file) = match function.split_once('@') {
        Some((f, file)) => (f, Some(file)),
        None => (function, None),
    };
    let function = kernel.function(name, file)?;
    let lines = kernel.debug.lines(&function)?;
    let decl_file = function.decl_file.clone().unwrap_or_default();
    println!("<{}@{}:0>", function.name, decl_file);
    let Some(last) = lines.iter().map(|l| l.line).max() else {
        println!("  (no line of {decl_file} has code in it)");
        return Ok(ExitCode::SUCCESS);
    };
    let text = read_source(&decl_file, args.source.as_deref());
    let first = function
        .decl_line
        .min(lines.iter().map(|l| l.line).min().unwrap_or(last));
    for n in first..=last {
        let numbered = lines.iter().any(|l| l.line == n);
        let number = if numbered {
            n.saturating_sub(function.decl_line).to_string()
        } else {
            String::new()
        };
        match &text {
            Some(source) => {
                let line = source.lines().nth((n as usize).saturating_sub(1)).unwrap_or("");
                println!("{number:>7}  {}", line.replace('\t', "        "));
            }
            None if numbered => println!("{number:>7}  ({decl_file}:{n})"),
            None => {}
        }
    }
    if text.is_none() {
        eprintln!("hvprobe: {decl_file}: source not found (give the tree with --source DIR); lines with code listed");
    }
    Ok(ExitCode::SUCCESS)
}

/// The text of a source file the DWARF names: as it is, or under `root` by its last
/// components.
fn read_source(path: &str, root: Option<&Path>) -> Option<String> {
    if let Ok(text) = std::fs::read_to_string(path) {
        return Some(text);
    }
    let root = root?;
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    (0..parts.len()).find_map(|skip| {
        let candidate: PathBuf = root.join(parts[skip..].join("/"));
        path_ends_with(&candidate.to_string_lossy(), parts[parts.len() - 1])
            .then(|| std::fs::read_to_string(&candidate).ok())
            .flatten()
    })
}

pub fn vars(args: VarsArgs) -> CliResult {
    let files = kernel_source(&args.dwarf)?;
    let point = source_point(&args.target)?;
    let kernel = source_of(&files, point.module.as_deref())?;
    let located = kernel.locate(&point)?;
    println!("Available variables at {}", args.target);
    for (site, scope) in &located.sites {
        println!("        @<{site}>");
        let variables = kernel.variables(site, scope)?;
        let width = variables
            .iter()
            .map(|(v, _)| kernel.debug.type_name(v.ty).len())
            .max()
            .unwrap_or(0);
        for (v, fetch) in variables {
            let ty = kernel.debug.type_name(v.ty);
            let kind = if v.is_parameter { "param" } else { "var" };
            match fetch {
                Ok(arg) => println!(
                    "                {ty:<width$}  {:<5} {}={}:{}",
                    kind, v.name, arg.expr, arg.ty
                ),
                Err(e) => {
                    let why = match e {
                        hvprobe_probes::spec::source::SourceError::Unavailable { reason, .. } => reason.to_string(),
                        hvprobe_probes::spec::source::SourceError::Field { problem, .. } => problem,
                        other => other.to_string(),
                    };
                    println!("                {ty:<width$}  {kind:<5} {} ({why})", v.name)
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
