//! Which functions a run traces, as ftrace's filter files take them.
//!
//! - `set_ftrace_filter`: globs (`*`, `?`, and hvprobe's `{a,b}` lists); a glob that starts
//!   with `!` takes the functions it matches out of those the globs before it chose. No
//!   glob but negations means every function less those. No glob at all: every function.
//! - `set_ftrace_notrace`: functions never traced, whatever the filter chose.
//! - `set_graph_function` / `set_graph_notrace` (function_graph): calls shown are those
//!   inside a call of a graph function (the function itself included); a call of a graph
//!   notrace function is not shown, nor is anything inside it. Both are applied to the hits
//!   on the host ([`crate::layout::GraphPrinter`]); the functions are still probed.
//! - [`DENIED`]: functions hvprobe leaves out of every function trace, the docs say why.
//!
//! `:mod:NAME` (a module's functions) is refused: the table holds the vmlinux's functions.

use hvprobe_spec::{is_wildcard_pattern, wildcard_matches};

use crate::available::{AvailableFunctions, TraceableFunction};

/// Functions hvprobe never traces, by glob, and why. Event detours call the kernel's
/// fault-safe copy routines to fetch memory arguments: a detour of ours inside them would
/// be entered again from a detour (each such hit is lost as nested, and costs the call
/// it interrupts). The guest's text patching (`text_poke*`) is where its own ftrace,
/// kprobes, jump labels and static calls write the text we share with it; a probe of ours
/// there would fire inside every change the guest makes to its code.
pub const DENIED: &[(&str, &str)] = &[
    ("copy_from_kernel_nofault*", "event detours call it to fetch memory"),
    ("copy_from_user_nofault", "event detours call it to fetch memory"),
    ("strncpy_from_kernel_nofault", "event detours call it to fetch strings"),
    ("strncpy_from_user_nofault", "event detours call it to fetch strings"),
    ("nmi_uaccess_okay", "the fault-safe user copies call it"),
    ("text_poke*", "the guest patches its own text with it"),
    ("__text_poke", "the guest patches its own text with it"),
];

/// Why a filter could not be taken.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum FilterError {
    #[error("{0:?}: an empty glob")]
    Empty(String),
    #[error(
        "{0:?}: module functions (`:mod:`) are not traced yet: the function table is the \
         vmlinux's; name the module's functions as probes (`p:GRP/ MOD:PATTERN`)"
    )]
    Module(String),
    #[error("{0:?}: no traceable function matches (see `hvprobe list functions`)")]
    MatchesNothing(String),
}

/// One line of a filter file.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Glob {
    negated: bool,
    pattern: String,
}

impl Glob {
    fn parse(text: &str) -> Result<Self, FilterError> {
        let trimmed = text.trim();
        if trimmed.contains(":mod:") {
            return Err(FilterError::Module(trimmed.to_owned()));
        }
        let (negated, pattern) = match trimmed.strip_prefix('!') {
            Some(rest) => (true, rest.trim()),
            None => (false, trimmed),
        };
        if pattern.is_empty() {
            return Err(FilterError::Empty(text.to_owned()));
        }
        Ok(Glob {
            negated,
            pattern: pattern.to_owned(),
        })
    }

    fn matches(&self, name: &str) -> bool {
        if is_wildcard_pattern(&self.pattern) {
            wildcard_matches(&self.pattern, name)
        } else {
            self.pattern == name
        }
    }
}

/// A list of globs, as one filter file holds them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GlobList(Vec<Glob>);

impl GlobList {
    /// The globs, each checked.
    pub fn parse<S: AsRef<str>>(globs: &[S]) -> Result<Self, FilterError> {
        globs
            .iter()
            .map(|g| Glob::parse(g.as_ref()))
            .collect::<Result<_, _>>()
            .map(GlobList)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether the list chooses `name`: the last glob that matches it decides (a negated
    /// one takes it out); with no positive glob, every name not taken out.
    pub fn chooses(&self, name: &str) -> bool {
        let mut chosen = !self.0.iter().any(|g| !g.negated);
        for glob in &self.0 {
            if glob.matches(name) {
                chosen = !glob.negated;
            }
        }
        chosen
    }

    /// Whether any glob of the list matches `name` (a negated one too).
    pub fn mentions(&self, name: &str) -> bool {
        self.0.iter().any(|g| g.matches(name))
    }

    /// The positive globs that match no function of `functions`.
    fn unmatched<'a>(&'a self, functions: &'a AvailableFunctions) -> impl Iterator<Item = &'a str> + 'a {
        self.0
            .iter()
            .filter(|g| !g.negated && !functions.valid().any(|f| g.matches(&f.name)))
            .map(|g| g.pattern.as_str())
    }
}

/// ftrace's four filter files.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FunctionFilter {
    pub filter: GlobList,
    pub notrace: GlobList,
    pub graph: GlobList,
    pub graph_notrace: GlobList,
}

/// What a filter chose of a kernel's functions.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selection {
    /// The functions to probe, in address order.
    pub traced: Vec<TraceableFunction>,
    /// Functions the filter chose that hvprobe leaves out, with the reason.
    pub denied: Vec<(TraceableFunction, &'static str)>,
}

impl FunctionFilter {
    /// The functions of `functions` to probe: chosen by the filter, not by notrace, not
    /// denied; for function_graph, the graph functions among them are needed even when the
    /// filter left them out (their calls open what is shown), so they are added. A positive
    /// glob that matches no function at all is an error, as the kernel refuses to write it.
    pub fn select(&self, functions: &AvailableFunctions) -> Result<Selection, FilterError> {
        for list in [&self.filter, &self.notrace, &self.graph, &self.graph_notrace] {
            if let Some(glob) = list.unmatched(functions).next() {
                return Err(FilterError::MatchesNothing(glob.to_owned()));
            }
        }
        let mut selection = Selection::default();
        for function in functions.valid() {
            let chosen = self.filter.chooses(&function.name)
                || (!self.graph.is_empty()
                    && self.graph.mentions(&function.name)
                    && self.graph.chooses(&function.name));
            if !chosen
                || (!self.notrace.is_empty()
                    && self.notrace.mentions(&function.name)
                    && self.notrace.chooses(&function.name))
            {
                continue;
            }
            match denied_reason(&function.name) {
                Some(why) => selection.denied.push((function.clone(), why)),
                None => selection.traced.push(function.clone()),
            }
        }
        Ok(selection)
    }
}

/// Why hvprobe leaves `name` out of function traces, if it does.
pub fn denied_reason(name: &str) -> Option<&'static str> {
    DENIED
        .iter()
        .find(|(glob, _)| wildcard_matches(glob, name))
        .map(|(_, why)| *why)
}

#[cfg(test)]
mod tests {
    use hvprobe_arch::Gva;

    use super::*;

    fn functions(names: &[&str]) -> AvailableFunctions {
        use hvprobe_introspection::symbols::{Symbol, SymbolSource, SymbolTable};
        let mut symbols: Vec<Symbol> = names
            .iter()
            .enumerate()
            .map(|(i, n)| Symbol {
                name: (*n).to_owned(),
                addr: Gva(0xffff_ffff_8100_0000 + 0x100 * i as u64),
                kind: 't',
                size: Some(0x100),
            })
            .collect();
        for (name, addr) in [
            ("_text", 0xffff_ffff_8100_0000),
            ("__init_begin", 0xffff_ffff_8200_0000),
            ("__init_end", 0xffff_ffff_8300_0000),
        ] {
            symbols.push(Symbol {
                name: name.to_owned(),
                addr: Gva(addr),
                kind: 'D',
                size: None,
            });
        }
        let table = SymbolTable::from_symbols(SymbolSource::SystemMap, symbols);
        let sites: Vec<Gva> = (0..names.len())
            .map(|i| Gva(0xffff_ffff_8100_0000 + 0x100 * i as u64))
            .collect();
        AvailableFunctions::from_locations(&sites, &table).unwrap()
    }

    fn traced(filter: &FunctionFilter, names: &[&str]) -> Vec<String> {
        filter
            .select(&functions(names))
            .unwrap()
            .traced
            .into_iter()
            .map(|f| f.name)
            .collect()
    }

    const NAMES: &[&str] = &[
        "vfs_read",
        "vfs_write",
        "ksys_read",
        "copy_from_kernel_nofault",
        "text_poke_bp",
    ];

    #[test]
    fn no_filter_traces_every_function_but_the_denied_ones() {
        let filter = FunctionFilter::default();
        assert_eq!(traced(&filter, NAMES), ["vfs_read", "vfs_write", "ksys_read"]);
        let selection = filter.select(&functions(NAMES)).unwrap();
        let denied: Vec<&str> = selection.denied.iter().map(|(f, _)| f.name.as_str()).collect();
        assert_eq!(denied, ["copy_from_kernel_nofault", "text_poke_bp"]);
    }

    #[test]
    fn a_negated_glob_takes_out_what_the_globs_before_it_chose() {
        let filter = FunctionFilter {
            filter: GlobList::parse(&["vfs_*", "ksys_read", "!vfs_write"]).unwrap(),
            ..Default::default()
        };
        assert_eq!(traced(&filter, NAMES), ["vfs_read", "ksys_read"]);
        let only_negations = FunctionFilter {
            filter: GlobList::parse(&["!vfs_*"]).unwrap(),
            ..Default::default()
        };
        assert_eq!(traced(&only_negations, NAMES), ["ksys_read"]);
    }

    #[test]
    fn notrace_wins_over_the_filter() {
        let filter = FunctionFilter {
            filter: GlobList::parse(&["*read"]).unwrap(),
            notrace: GlobList::parse(&["vfs_*"]).unwrap(),
            ..Default::default()
        };
        assert_eq!(traced(&filter, NAMES), ["ksys_read"]);
    }

    #[test]
    fn graph_functions_are_probed_even_when_the_filter_leaves_them_out() {
        let filter = FunctionFilter {
            filter: GlobList::parse(&["vfs_read"]).unwrap(),
            graph: GlobList::parse(&["ksys_read"]).unwrap(),
            ..Default::default()
        };
        assert_eq!(traced(&filter, NAMES), ["vfs_read", "ksys_read"]);
    }

    #[test]
    fn a_glob_that_matches_nothing_and_a_module_glob_are_refused_by_name() {
        let filter = FunctionFilter {
            filter: GlobList::parse(&["no_such_fn*"]).unwrap(),
            ..Default::default()
        };
        assert_eq!(
            filter.select(&functions(NAMES)),
            Err(FilterError::MatchesNothing("no_such_fn*".to_owned()))
        );
        assert!(matches!(GlobList::parse(&["*:mod:ext4"]), Err(FilterError::Module(_))));
        assert!(matches!(GlobList::parse(&["!"]), Err(FilterError::Empty(_))));
    }
}
