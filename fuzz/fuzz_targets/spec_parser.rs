//! Fuzzes the kprobe_events spec parser (`hvprobe_probes::spec`).
//!
//! Input: arbitrary bytes, turned into text with `String::from_utf8_lossy` (valid UTF-8 is
//! used as is; invalid sequences become U+FFFD, so multi-byte characters are exercised
//! either way). The text is parsed as one line (`parse_line`, which also sees any `\n` as
//! a separator) and as a file (`parse_file`, `parse_file_numbered`).
//!
//! Properties, beyond "no panic":
//! - an accepted line displays as a canonical line that parses back to an equal spec, and
//!   displays the same again (the round trip of the proptests in `spec/tests.rs`);
//! - an error's line is 1 (`parse_line`) or the number of an existing line (`parse_file`),
//!   its column lies within that line (1 ..= characters + 1), it displays as
//!   `[FILE:]LINE:COLUMN: message`, and a file error is exactly the error of its line alone,
//!   every earlier line being accepted;
//! - leading blanks shift an error's column by their number and change nothing else, and
//!   a trailing ` #comment` changes nothing;
//! - an accepted file is the accepted lines, in order, with their numbers, and the
//!   canonical lines joined as a file parse back to the same specs.
#![no_main]

use hvprobe_probes::spec::{parse_file, parse_file_numbered, parse_line, ProbeSpec, SpecError};
use libfuzzer_sys::fuzz_target;

const FILE: &str = "fuzz.spec";

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    check_line(&text);
    check_file(&text);
});

/// An error found in `line` (line number `number`, file `file`) points inside it.
fn check_error_position(e: &SpecError, line: &str, number: usize, file: Option<&str>) {
    assert_eq!(e.line, number, "{e:?} in {line:?}");
    assert_eq!(e.file.as_deref(), file, "{e:?}");
    let chars = line.chars().count();
    assert!(
        (1..=chars + 1).contains(&e.column),
        "column {} outside 1..={} in {line:?}: {e:?}",
        e.column,
        chars + 1
    );
    let shown = e.to_string();
    let prefix = match file {
        Some(f) => format!("{f}:{number}:{}: ", e.column),
        None => format!("{number}:{}: ", e.column),
    };
    assert!(shown.starts_with(&prefix), "{shown:?} does not start with {prefix:?}");
    assert!(shown.len() > prefix.len(), "empty message: {shown:?}");
}

/// Display then parse gives the same spec, and the canonical text is a fixed point.
fn check_round_trip(spec: &ProbeSpec) -> String {
    let canonical = spec.to_string();
    assert!(
        !canonical.contains(['\n', '\r', '#']),
        "canonical text {canonical:?} is not one line"
    );
    match parse_line(&canonical) {
        Ok(Some(again)) => {
            assert_eq!(&again, spec, "canonical text {canonical:?} parses to something else");
            assert_eq!(again.to_string(), canonical, "canonical text is not a fixed point");
        }
        other => panic!("canonical text {canonical:?} of {spec:?} does not parse back: {other:?}"),
    }
    canonical
}

fn check_line(text: &str) {
    let result = parse_line(text);
    match &result {
        Ok(Some(spec)) => {
            check_round_trip(spec);
        }
        Ok(None) => {}
        Err(e) => check_error_position(e, text, 1, None),
    }
    // Leading blanks move an error right by as many characters and change nothing else;
    // a trailing comment changes nothing at all.
    let shifted = parse_line(&format!(" \t{text}"));
    match (&result, &shifted) {
        (Err(e), Err(s)) => assert_eq!((s.column, &s.kind), (e.column + 2, &e.kind), "{text:?}"),
        _ => assert_eq!(&shifted, &result, "{text:?} with leading blanks"),
    }
    assert_eq!(parse_line(&format!("{text} #c")), result, "{text:?} with a comment");
}

fn check_file(text: &str) {
    let lines: Vec<&str> = text.lines().collect();
    let numbered = parse_file_numbered(text, FILE);
    let plain = parse_file(text, FILE);
    match (&numbered, &plain) {
        (Ok(numbered), Ok(plain)) => {
            let specs: Vec<ProbeSpec> = numbered.iter().map(|(_, s)| s.clone()).collect();
            assert_eq!(&specs, plain, "parse_file and parse_file_numbered disagree");
            // Exactly the lines that hold a probe, in order, each as parse_line reads it.
            let mut expected = Vec::new();
            for (index, line) in lines.iter().enumerate() {
                match parse_line(line) {
                    Ok(Some(spec)) => expected.push((index + 1, spec)),
                    Ok(None) => {}
                    Err(e) => panic!("file accepted, but line {} alone fails: {e}", index + 1),
                }
            }
            assert_eq!(numbered, &expected);
            // The canonical lines joined as a file read back the same.
            let canonical: Vec<String> = plain.iter().map(check_round_trip).collect();
            assert_eq!(parse_file(&canonical.join("\n"), FILE).as_ref(), Ok(plain));
        }
        (Err(e), Err(e2)) => {
            assert_eq!(e, e2, "parse_file and parse_file_numbered disagree");
            assert!(
                e.line >= 1 && e.line <= lines.len(),
                "error line {} of a {}-line file",
                e.line,
                lines.len()
            );
            let line = lines[e.line - 1];
            check_error_position(e, line, e.line, Some(FILE));
            // The first failing line, and failing the same way alone.
            for (index, earlier) in lines[..e.line - 1].iter().enumerate() {
                assert!(
                    parse_line(earlier).is_ok(),
                    "line {} fails but the error is on line {}",
                    index + 1,
                    e.line
                );
            }
            let alone = parse_line(line).expect_err("the failing line parses alone");
            assert_eq!((alone.column, &alone.kind), (e.column, &e.kind));
        }
        _ => panic!("parse_file {plain:?} and parse_file_numbered {numbered:?} disagree"),
    }
}
