//! Event filters in ftrace's grammar (what one writes to `events/GRP/EVENT/filter`, and
//! after `if` in a trigger), evaluated on the host per hit.
//!
//! ```text
//! filter     := or
//! or         := and ( "||" and )*
//! and        := unary ( "&&" unary )*          ("&&" binds tighter than "||")
//! unary      := "!" unary | "(" or ")" | comparison
//! comparison := FIELD OP VALUE
//! ```
//!
//! As Linux 6.1's `trace_events_filter.c`:
//!
//! - `FIELD` is `[A-Za-z0-9_]+`, looked up as [`EventFields::lookup`] says.
//! - Numeric fields take `== != < <= > >=` and `&` (true when the bitwise and is not 0),
//!   with a decimal, `0x` hex or `0` octal literal (`kstrtoull`/`kstrtoll` with base 0; a
//!   `-` only for signed fields). Both sides are cut to the field's size and compared
//!   signed or unsigned as the field is (`(s32)val`, as the kernel's per-type predicates).
//! - String fields take `==`, `!=` and `~` with a value in `"..."` or `'...'` (no escapes;
//!   unquoted strings are refused, as in 6.1). `==` is an exact match. `~` is the kernel's
//!   glob: a leading `!` negates it; `abc*`, `*abc`, `*abc*` are prefix, suffix and
//!   substring matches, and any other `*`, `?`, `[...]` (with `!` and ranges) or `\` makes
//!   it a full `glob_match`. (The kernel's suffix match on `comm` compares the end of the
//!   16-byte buffer rather than of the name, so `comm ~ "*sh"` never matches there;
//!   here it matches names that end in `sh`.)
//! - Where a fetch faulted the kernel compares whatever its record holds; here every
//!   comparison of a faulted value is false (also `!=`).
//!
//! Errors carry the byte offset in the expression where they are, for the caller to turn
//! into a column.

use hvprobe_probes::detour::event::filter::{NumberOp, RecordCheck, RecordField, RecordFilter, RecordTest};
use hvprobe_probes::spec::FetchArg;

use crate::fields::{EventFields, Field, FieldError, FieldSource, FieldType, FieldValue};

/// Longest quoted string operand, NUL included (the kernel's `MAX_FILTER_STR_VAL`).
pub const MAX_STRING_OPERAND: usize = 256;
/// Longest numeric operand, NUL included (the kernel's `num_buf`).
const MAX_NUMBER_OPERAND: usize = 24;
/// Deepest nesting of `(` and `!` (the parser recurses).
const MAX_NESTING: usize = 256;

/// A comparison operator, in the order the kernel tries them (so `<=` before `<`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Glob,
    Ne,
    Eq,
    Le,
    Lt,
    Ge,
    Gt,
    BitAnd,
}

impl Op {
    const ALL: [Op; 8] = [Op::Glob, Op::Ne, Op::Eq, Op::Le, Op::Lt, Op::Ge, Op::Gt, Op::BitAnd];

    pub const fn text(self) -> &'static str {
        match self {
            Op::Glob => "~",
            Op::Ne => "!=",
            Op::Eq => "==",
            Op::Le => "<=",
            Op::Lt => "<",
            Op::Ge => ">=",
            Op::Gt => ">",
            Op::BitAnd => "&",
        }
    }
}

/// What is wrong with a filter.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FilterErrorKind {
    #[error("empty filter")]
    Empty,
    #[error("expected a field name, `(` or `!`")]
    ExpectedComparison,
    #[error("expected an operator after the field: ==, !=, <, <=, >, >=, & or ~")]
    InvalidOperator,
    #[error("expected `&&`, `||`, `)` or the end after a comparison")]
    ExpectedLogical,
    #[error("missing `)`")]
    MissingCloseParen,
    #[error("`)` without a `(`")]
    UnbalancedCloseParen,
    #[error("nested deeper than {MAX_NESTING} `(` and `!`")]
    TooDeep,
    #[error("missing the closing quote")]
    MissingQuote,
    #[error("operand longer than {} characters", .0 - 1)]
    OperandTooLong(usize),
    #[error("expected a number or a quoted string (did you forget the quotes?)")]
    InvalidValue,
    #[error(transparent)]
    Field(#[from] FieldError),
    #[error("field `{0}` is a string: compare it with a quoted string")]
    ExpectString(String),
    #[error("field `{0}` is a number: compare it with a number, not a string")]
    ExpectNumber(String),
    #[error("`{op}` does not apply to {} field `{field}` ({})", if *.string { "string" } else { "numeric" },
        if *.string { "==, != and ~ do" } else { "==, !=, <, <=, >, >= and & do" })]
    IllegalOperator {
        op: &'static str,
        field: String,
        string: bool,
    },
    #[error("`{text}` is not a valid {} value for field `{field}`", if *.signed { "signed" } else { "unsigned" })]
    IllegalInteger { text: String, field: String, signed: bool },
}

/// A filter error, at a byte offset into the expression.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{kind}")]
pub struct FilterError {
    pub offset: usize,
    pub kind: FilterErrorKind,
}

/// A filter's tree of `||`, `&&` and `!` over comparisons of type `C`.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Node<C> {
    Or(Box<Node<C>>, Box<Node<C>>),
    And(Box<Node<C>>, Box<Node<C>>),
    Not(Box<Node<C>>),
    Leaf(C),
}

impl<C> Node<C> {
    fn try_map<D, E>(&self, f: &mut impl FnMut(&C) -> Result<D, E>) -> Result<Node<D>, E> {
        Ok(match self {
            Node::Or(a, b) => Node::Or(Box::new(a.try_map(f)?), Box::new(b.try_map(f)?)),
            Node::And(a, b) => Node::And(Box::new(a.try_map(f)?), Box::new(b.try_map(f)?)),
            Node::Not(a) => Node::Not(Box::new(a.try_map(f)?)),
            Node::Leaf(c) => Node::Leaf(f(c)?),
        })
    }
}

/// A comparison as written.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Comparison {
    field: String,
    field_at: usize,
    op: Op,
    operand: Operand,
    operand_at: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Operand {
    /// The bytes between the quotes.
    Quoted(Vec<u8>),
    /// `-`? then letters and digits, checked once the field's signedness is known.
    Number(String),
}

/// A filter as parsed, before its field names are looked up in an event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FilterExpr {
    text: String,
    root: Node<Comparison>,
}

impl FilterExpr {
    /// Parses a filter's text (surrounding whitespace allowed).
    pub fn parse(text: &str) -> Result<FilterExpr, FilterError> {
        let mut parser = Parser {
            bytes: text.as_bytes(),
            at: 0,
            depth: 0,
        };
        parser.skip_spaces();
        if parser.at == text.len() {
            return Err(FilterError {
                offset: parser.at,
                kind: FilterErrorKind::Empty,
            });
        }
        let root = parser.or()?;
        parser.skip_spaces();
        if let Some(&c) = parser.bytes.get(parser.at) {
            let kind = if c == b')' {
                FilterErrorKind::UnbalancedCloseParen
            } else {
                FilterErrorKind::ExpectedLogical
            };
            return Err(parser.error(kind));
        }
        Ok(FilterExpr {
            text: text.trim().to_owned(),
            root,
        })
    }

    /// The text, as given (trimmed).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The filter for an event with these fields: every field must exist and take its
    /// comparison.
    pub fn bind(&self, fields: &EventFields) -> Result<Filter, FilterError> {
        let root = self.root.try_map(&mut |c| bind_comparison(c, fields))?;
        Ok(Filter {
            text: self.text.clone(),
            root,
        })
    }
}

struct Parser<'a> {
    bytes: &'a [u8],
    at: usize,
    depth: usize,
}

impl Parser<'_> {
    fn error(&self, kind: FilterErrorKind) -> FilterError {
        FilterError { offset: self.at, kind }
    }

    fn skip_spaces(&mut self) {
        while self.bytes.get(self.at).is_some_and(u8::is_ascii_whitespace) {
            self.at += 1;
        }
    }

    fn eat(&mut self, token: &str) -> bool {
        self.skip_spaces();
        if self.bytes[self.at..].starts_with(token.as_bytes()) {
            self.at += token.len();
            true
        } else {
            false
        }
    }

    fn or(&mut self) -> Result<Node<Comparison>, FilterError> {
        let mut left = self.and()?;
        while self.eat("||") {
            left = Node::Or(Box::new(left), Box::new(self.and()?));
        }
        Ok(left)
    }

    fn and(&mut self) -> Result<Node<Comparison>, FilterError> {
        let mut left = self.unary()?;
        while self.eat("&&") {
            left = Node::And(Box::new(left), Box::new(self.unary()?));
        }
        Ok(left)
    }

    fn unary(&mut self) -> Result<Node<Comparison>, FilterError> {
        self.skip_spaces();
        if self.depth >= MAX_NESTING {
            return Err(self.error(FilterErrorKind::TooDeep));
        }
        let node = match self.bytes.get(self.at) {
            Some(b'!') => {
                self.at += 1;
                self.depth += 1;
                Node::Not(Box::new(self.unary()?))
            }
            Some(b'(') => {
                self.at += 1;
                self.depth += 1;
                let inner = self.or()?;
                if !self.eat(")") {
                    return Err(self.error(FilterErrorKind::MissingCloseParen));
                }
                inner
            }
            _ => return self.comparison().map(Node::Leaf),
        };
        self.depth -= 1;
        Ok(node)
    }

    fn comparison(&mut self) -> Result<Comparison, FilterError> {
        let field_at = self.at;
        while self
            .bytes
            .get(self.at)
            .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_')
        {
            self.at += 1;
        }
        if self.at == field_at {
            return Err(self.error(FilterErrorKind::ExpectedComparison));
        }
        let field = String::from_utf8_lossy(&self.bytes[field_at..self.at]).into_owned();
        self.skip_spaces();
        let op = Op::ALL
            .into_iter()
            .find(|op| self.bytes[self.at..].starts_with(op.text().as_bytes()))
            .ok_or_else(|| self.error(FilterErrorKind::InvalidOperator))?;
        self.at += op.text().len();
        self.skip_spaces();
        let operand_at = self.at;
        let operand = match self.bytes.get(self.at) {
            Some(&quote @ (b'"' | b'\'')) => {
                let start = self.at + 1;
                let len = self.bytes[start..]
                    .iter()
                    .position(|&c| c == quote)
                    .ok_or(FilterError {
                        offset: self.bytes.len(),
                        kind: FilterErrorKind::MissingQuote,
                    })?;
                if len >= MAX_STRING_OPERAND {
                    return Err(self.error(FilterErrorKind::OperandTooLong(MAX_STRING_OPERAND)));
                }
                self.at = start + len + 1;
                Operand::Quoted(self.bytes[start..start + len].to_vec())
            }
            Some(c) if c.is_ascii_digit() || *c == b'-' => {
                self.at += 1;
                while self.bytes.get(self.at).is_some_and(u8::is_ascii_alphanumeric) {
                    self.at += 1;
                }
                if self.at - operand_at >= MAX_NUMBER_OPERAND {
                    return Err(self.error(FilterErrorKind::OperandTooLong(MAX_NUMBER_OPERAND)));
                }
                Operand::Number(String::from_utf8_lossy(&self.bytes[operand_at..self.at]).into_owned())
            }
            _ => return Err(self.error(FilterErrorKind::InvalidValue)),
        };
        Ok(Comparison {
            field,
            field_at,
            op,
            operand,
            operand_at,
        })
    }
}

/// A filter bound to one event's fields, ready to test hits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    text: String,
    root: Node<Test>,
}

/// One comparison with its field resolved and its operand converted.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Test {
    field: Field,
    check: Check,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Check {
    /// `field OP value`, both sides normalized to the field's type.
    Number { op: Op, value: u64, ty: FieldType },
    /// A string match, negated by `!=` or a `~ "!..."` pattern.
    String { pattern: StringPattern, negate: bool },
}

/// How a string operand matches (the kernel's `regex_type`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StringPattern {
    Full(Vec<u8>),
    Prefix(Vec<u8>),
    Substring(Vec<u8>),
    Suffix(Vec<u8>),
    Glob(Vec<u8>),
}

impl StringPattern {
    /// A `~` operand as `filter_parse_regex` reads it: the pattern and whether a leading
    /// `!` negates it.
    pub fn glob(operand: &[u8]) -> (StringPattern, bool) {
        let (negate, text) = match operand.split_first() {
            Some((b'!', rest)) => (true, rest),
            _ => (false, operand),
        };
        if text.first().is_some_and(u8::is_ascii_digit) {
            return (StringPattern::Full(text.to_vec()), negate);
        }
        let last = text.len().saturating_sub(1);
        let mut suffix = false;
        for (i, &c) in text.iter().enumerate() {
            if c == b'*' {
                if i == 0 {
                    suffix = true;
                } else if i == last {
                    let start = usize::from(suffix);
                    let kept = text[start..i].to_vec();
                    let pattern = if suffix {
                        StringPattern::Substring(kept)
                    } else {
                        StringPattern::Prefix(kept)
                    };
                    return (pattern, negate);
                } else {
                    return (StringPattern::Glob(text.to_vec()), negate);
                }
            } else if matches!(c, b'[' | b'?' | b'\\') {
                return (StringPattern::Glob(text.to_vec()), negate);
            }
        }
        let pattern = if suffix {
            StringPattern::Suffix(text[1..].to_vec())
        } else {
            StringPattern::Full(text.to_vec())
        };
        (pattern, negate)
    }

    pub fn matches(&self, s: &[u8]) -> bool {
        match self {
            StringPattern::Full(p) => s == p.as_slice(),
            StringPattern::Prefix(p) => s.starts_with(p),
            StringPattern::Suffix(p) => s.ends_with(p),
            StringPattern::Substring(p) => p.is_empty() || s.windows(p.len()).any(|w| w == p.as_slice()),
            StringPattern::Glob(p) => glob_match(p, s),
        }
    }
}

/// The kernel's `glob_match` (`lib/glob.c`): `?` any one byte, `*` any run, `[...]` a class
/// (`!` complements it, `a-z` ranges, a `]` first is literal; an unclosed `[` is literal),
/// `\` quotes the next byte. The whole of `s` must match.
pub fn glob_match(pattern: &[u8], s: &[u8]) -> bool {
    let p = |i: usize| pattern.get(i).copied().unwrap_or(0);
    let c_at = |i: usize| s.get(i).copied().unwrap_or(0);
    let (mut pi, mut si) = (0usize, 0usize);
    // Where the last `*` was: the pattern after it, and where in `s` it started matching.
    let mut back: Option<(usize, usize)> = None;
    loop {
        let c = c_at(si);
        let mut d = p(pi);
        pi += 1;
        si += 1;
        let mut literal = true;
        let mut matched = false;
        match d {
            b'?' => {
                literal = false;
                matched = c != 0;
            }
            b'*' => {
                if p(pi) == 0 {
                    return true;
                }
                si -= 1;
                back = Some((pi, si));
                continue;
            }
            b'[' => {
                let inverted = p(pi) == b'!';
                let mut class = pi + usize::from(inverted);
                let mut a = p(class);
                class += 1;
                let mut in_class = false;
                let mut malformed = false;
                loop {
                    let mut b = a;
                    if a == 0 {
                        malformed = true;
                        break;
                    }
                    if p(class) == b'-' && p(class + 1) != b']' {
                        b = p(class + 1);
                        if b == 0 {
                            malformed = true;
                            break;
                        }
                        class += 2;
                    }
                    in_class |= a <= c && c <= b;
                    a = p(class);
                    class += 1;
                    if a == b']' {
                        break;
                    }
                }
                if !malformed {
                    literal = false;
                    matched = in_class != inverted;
                    if matched {
                        pi = class;
                    }
                }
            }
            b'\\' => {
                d = p(pi);
                pi += 1;
            }
            _ => {}
        }
        if literal {
            if c == d {
                if d == 0 {
                    return true;
                }
                continue;
            }
        } else if matched {
            continue;
        }
        // Backtrack: the last `*` eats one more byte.
        match back {
            Some((bp, bs)) if c != 0 => {
                back = Some((bp, bs + 1));
                pi = bp;
                si = bs + 1;
            }
            _ => return false,
        }
    }
}

fn bind_comparison(c: &Comparison, fields: &EventFields) -> Result<Test, FilterError> {
    let field = fields.lookup(&c.field).map_err(|e| FilterError {
        offset: c.field_at,
        kind: e.into(),
    })?;
    let at = |kind| FilterError {
        offset: c.operand_at,
        kind,
    };
    let is_string = field.ty == FieldType::String;
    let check = match &c.operand {
        Operand::Quoted(bytes) => {
            // The kernel checks the operator first, then the field's type.
            if !matches!(c.op, Op::Eq | Op::Ne | Op::Glob) {
                return Err(at(FilterErrorKind::IllegalOperator {
                    op: c.op.text(),
                    field: field.name.clone(),
                    string: is_string,
                }));
            }
            if !is_string {
                return Err(at(FilterErrorKind::ExpectNumber(field.name.clone())));
            }
            match c.op {
                Op::Glob => {
                    let (pattern, negate) = StringPattern::glob(bytes);
                    Check::String { pattern, negate }
                }
                op => Check::String {
                    pattern: StringPattern::Full(bytes.clone()),
                    negate: op == Op::Ne,
                },
            }
        }
        Operand::Number(text) => {
            if is_string {
                return Err(at(FilterErrorKind::ExpectString(field.name.clone())));
            }
            if c.op == Op::Glob {
                return Err(at(FilterErrorKind::IllegalOperator {
                    op: c.op.text(),
                    field: field.name.clone(),
                    string: false,
                }));
            }
            let signed = field.ty.is_signed();
            let value = if signed {
                parse_signed(text).map(|v| v as u64)
            } else {
                parse_unsigned(text)
            }
            .ok_or_else(|| {
                at(FilterErrorKind::IllegalInteger {
                    text: text.clone(),
                    field: field.name.clone(),
                    signed,
                })
            })?;
            Check::Number {
                op: c.op,
                value: field.ty.normalize(value),
                ty: field.ty,
            }
        }
    };
    Ok(Test { field, check })
}

/// `kstrtoull(text, 0)`: `0x` hex, a leading `0` octal, else decimal; no sign.
pub fn parse_unsigned(text: &str) -> Option<u64> {
    let (digits, radix) = if let Some(hex) = text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        (hex, 16)
    } else if text.len() > 1 && text.starts_with('0') {
        (&text[1..], 8)
    } else {
        (text, 10)
    };
    if digits.is_empty() || !digits.bytes().all(|c| c.is_ascii_alphanumeric()) {
        return None;
    }
    u64::from_str_radix(digits, radix).ok()
}

/// `kstrtoll(text, 0)`: [`parse_unsigned`] with an optional `-`, within `i64`.
pub fn parse_signed(text: &str) -> Option<i64> {
    match text.strip_prefix('-') {
        Some(magnitude) => {
            let m = parse_unsigned(magnitude)?;
            if m <= 1 << 63 {
                Some((m as i64).wrapping_neg())
            } else {
                None
            }
        }
        None => i64::try_from(parse_unsigned(text)?).ok(),
    }
}

impl Filter {
    /// The filter's text, as given.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Whether `hit` passes.
    pub fn matches(&self, hit: &hvprobe_probes::output::HitRecord) -> bool {
        eval(&self.root, hit)
    }

    /// This filter for the event detour of a probe with `args`: the comparisons a record
    /// holds the answer to, the others [`RecordFilter::HostOnly`] (a glob other than a
    /// prefix, a field the probe's args do not have with the bound type). The detour runs
    /// what it can of it; this filter still decides on the host.
    pub fn record_filter(&self, args: &[FetchArg]) -> RecordFilter {
        record_node(&self.root, args)
    }
}

fn record_node(node: &Node<Test>, args: &[FetchArg]) -> RecordFilter {
    let both = |a: &Node<Test>, b: &Node<Test>| (Box::new(record_node(a, args)), Box::new(record_node(b, args)));
    match node {
        Node::Or(a, b) => {
            let (a, b) = both(a, b);
            RecordFilter::Or(a, b)
        }
        Node::And(a, b) => {
            let (a, b) = both(a, b);
            RecordFilter::And(a, b)
        }
        Node::Not(a) => RecordFilter::Not(Box::new(record_node(a, args))),
        Node::Leaf(test) => test
            .record_test(args)
            .map_or(RecordFilter::HostOnly, RecordFilter::Test),
    }
}

impl Test {
    fn record_test(&self, args: &[FetchArg]) -> Option<RecordTest> {
        let field = match self.field.source {
            // By name, in the probe's own args, with the type the filter was bound to.
            FieldSource::Arg(_) => RecordField::Arg(args.iter().position(|a| {
                a.name == self.field.name && a.array_len.is_none() && FieldType::of_arg_type(a.ty) == self.field.ty
            })?),
            FieldSource::CommonPid => RecordField::Pid,
            FieldSource::Comm => RecordField::Comm,
            FieldSource::Cpu => RecordField::Cpu,
            FieldSource::Stacktrace => return None,
        };
        let check = match (&self.check, self.field.ty) {
            (&Check::Number { op, value, .. }, FieldType::Number { size, signed }) => RecordCheck::Number {
                op: match op {
                    Op::Eq => NumberOp::Eq,
                    Op::Ne => NumberOp::Ne,
                    Op::Lt => NumberOp::Lt,
                    Op::Le => NumberOp::Le,
                    Op::Gt => NumberOp::Gt,
                    Op::Ge => NumberOp::Ge,
                    Op::BitAnd => NumberOp::BitAnd,
                    Op::Glob => return None,
                },
                value,
                size,
                signed,
            },
            (Check::String { pattern, negate }, FieldType::String) => {
                let (pattern, whole) = match pattern {
                    StringPattern::Full(p) => (p, true),
                    StringPattern::Prefix(p) => (p, false),
                    _ => return None,
                };
                RecordCheck::Bytes {
                    pattern: pattern.clone(),
                    whole,
                    negate: *negate,
                }
            }
            _ => return None,
        };
        Some(RecordTest { field, check })
    }
}

fn eval(node: &Node<Test>, hit: &hvprobe_probes::output::HitRecord) -> bool {
    match node {
        Node::Or(a, b) => eval(a, hit) || eval(b, hit),
        Node::And(a, b) => eval(a, hit) && eval(b, hit),
        Node::Not(a) => !eval(a, hit),
        Node::Leaf(test) => test.passes(hit),
    }
}

impl Test {
    fn passes(&self, hit: &hvprobe_probes::output::HitRecord) -> bool {
        match (&self.check, self.field.value(hit)) {
            (&Check::Number { op, value, ty }, FieldValue::Number(v)) => compare(op, ty.normalize(v), value, ty),
            (Check::String { pattern, negate }, FieldValue::Str(s)) => pattern.matches(s) != *negate,
            _ => false,
        }
    }
}

/// `a OP b` for two values already normalized to `ty`.
fn compare(op: Op, a: u64, b: u64, ty: FieldType) -> bool {
    let order = if ty.is_signed() {
        (a as i64).cmp(&(b as i64))
    } else {
        a.cmp(&b)
    };
    match op {
        Op::Eq => a == b,
        Op::Ne => a != b,
        Op::Lt => order.is_lt(),
        Op::Le => order.is_le(),
        Op::Gt => order.is_gt(),
        Op::Ge => order.is_ge(),
        Op::BitAnd => a & b != 0,
        // Refused when the filter is bound.
        Op::Glob => false,
    }
}

#[cfg(test)]
mod tests;
