//! Symbol patterns as Linux's probe events and ftrace's filters take them: globs (`*`, `?`)
//! and brace lists (`{vfs_read,vfs_write}`), with a bound on how many names a list expands to.

/// Whether a symbol name is a pattern over many functions: a glob (`*`, `?`) or an
/// explicit list (`{vfs_read,vfs_write}`, `vfs_{read,write}`).
pub fn is_wildcard_pattern(name: &str) -> bool {
    name.contains(['*', '?', '{'])
}

/// Whether `name` matches `pattern`: `*` any run of characters, `?` any one, as
/// bpftrace's `kprobe:vfs_*` and ftrace's `set_ftrace_filter` globs do; `{a,b}` either
/// alternative, as in a shell (braces do not nest; an unbalanced one matches nothing).
pub fn wildcard_matches(pattern: &str, name: &str) -> bool {
    brace_alternatives(pattern).is_some_and(|globs| globs.iter().any(|g| glob_matches(g, name)))
}

/// Most names a pattern's `{a,b}` lists may stand for: each list multiplies the others,
/// so a few long lists would otherwise ask for more memory than there is (the spec fuzzer
/// found one that did).
pub const MAX_BRACE_ALTERNATIVES: usize = 1024;

/// How many names a pattern's `{a,b}` lists stand for (the product of their lengths,
/// saturating), without building them.
pub(crate) fn brace_alternative_count(pattern: &str) -> usize {
    let mut count = 1usize;
    let mut rest = pattern;
    while let Some(open) = rest.find('{') {
        let Some(close) = rest[open..].find('}') else {
            break;
        };
        let list = &rest[open + 1..open + close];
        count = count.saturating_mul(list.split(',').count());
        rest = &rest[open + close + 1..];
    }
    count
}

/// The globs a pattern's `{a,b}` lists stand for (the product of every list), or None
/// when a brace is unbalanced or nested, or the lists stand for more than
/// [`MAX_BRACE_ALTERNATIVES`] names.
pub fn brace_alternatives(pattern: &str) -> Option<Vec<String>> {
    if brace_alternative_count(pattern) > MAX_BRACE_ALTERNATIVES {
        return None;
    }
    expand_braces(pattern)
}

pub(crate) fn expand_braces(pattern: &str) -> Option<Vec<String>> {
    let Some(open) = pattern.find('{') else {
        return (!pattern.contains('}')).then(|| vec![pattern.to_owned()]);
    };
    let close = open + pattern[open..].find('}')?;
    let (head, list, tail) = (&pattern[..open], &pattern[open + 1..close], &pattern[close + 1..]);
    if head.contains('}') || list.contains('{') {
        return None;
    }
    let tails = expand_braces(tail)?;
    Some(
        list.split(',')
            .flat_map(|alt| tails.iter().map(move |t| format!("{head}{alt}{t}")))
            .collect(),
    )
}

pub(crate) fn glob_matches(pattern: &str, name: &str) -> bool {
    let (p, n) = (pattern.as_bytes(), name.as_bytes());
    let (mut pi, mut ni) = (0, 0);
    // Where the last `*` was, and how much of the name it has eaten.
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() && (p[pi] == b'?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, ni));
            pi += 1;
        } else if let Some((sp, sn)) = star {
            pi = sp + 1;
            ni = sn + 1;
            star = Some((sp, sn + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}
