use hvprobe_probes::fetch::ArgValue;

use super::*;
use crate::test_support::{args_of, hit};

#[test]
fn fetch_arg_types_become_the_kernels_field_types() {
    let fields = EventFields::new(&args_of(
        "p:g/e f a=%di:u8 b=%si:s16 c=%dx x=%cx:x32 s=+0(%di):string y=%r8:symbol w=%r9:b3@2/32 n=$comm",
    ));
    let ty = |n: &str| fields.lookup(n).unwrap().ty;
    assert_eq!(ty("a"), FieldType::Number { size: 1, signed: false });
    assert_eq!(ty("b"), FieldType::Number { size: 2, signed: true });
    assert_eq!(
        ty("c"),
        FieldType::Number { size: 8, signed: false },
        "the default type is x64"
    );
    assert_eq!(ty("x"), FieldType::Number { size: 4, signed: false });
    assert_eq!(ty("s"), FieldType::String);
    assert_eq!(ty("y"), FieldType::Number { size: 8, signed: false });
    assert_eq!(ty("w"), FieldType::Number { size: 4, signed: false });
    assert_eq!(ty("n"), FieldType::String);
}

#[test]
fn the_events_own_fields_come_before_the_generic_ones() {
    let fields = EventFields::new(&args_of("p:g/e f cpu=%di:u8"));
    assert_eq!(fields.lookup("cpu").unwrap().source, FieldSource::Arg(0));
    assert_eq!(fields.lookup("CPU").unwrap().source, FieldSource::Cpu);
    assert_eq!(fields.lookup("comm").unwrap().source, FieldSource::Comm);
    assert_eq!(
        fields.lookup("common_pid").unwrap().ty,
        FieldType::Number { size: 4, signed: true }
    );
}

#[test]
fn unknown_array_and_guest_state_fields_are_refused_with_the_reason() {
    let fields = EventFields::new(&args_of("p:g/e f a=%di arr=+0(%si):u32[4]"));
    assert_eq!(
        fields.lookup("b").unwrap_err().to_string(),
        "no field `b` (this event has a, arr, common_pid, comm, cpu)"
    );
    assert_eq!(fields.lookup("arr").unwrap_err(), FieldError::Array("arr".into()));
    assert_eq!(
        fields.lookup("common_preempt_count").unwrap_err(),
        FieldError::NotOnHost("common_preempt_count".into())
    );
}

#[test]
fn values_come_from_the_hit_sign_extended_or_missing() {
    let fields = EventFields::new(&args_of("p:g/e f a=%di:s32 s=+0(%si):string y=%dx:symbol"));
    let h = hit(
        "sh",
        -1,
        3,
        vec![
            ("a", ArgValue::Signed(-2)),
            ("s", ArgValue::Fault),
            (
                "y",
                ArgValue::Symbol {
                    address: 0xffff_ffff_8100_0000,
                    description: None,
                },
            ),
        ],
    );
    let value = |n: &str| fields.lookup(n).unwrap().value(&h);
    assert_eq!(value("a"), FieldValue::Number(-2i64 as u64));
    assert_eq!(value("s"), FieldValue::Missing);
    assert_eq!(value("y"), FieldValue::Number(0xffff_ffff_8100_0000));
    assert_eq!(value("common_pid"), FieldValue::Number(u64::MAX));
    assert_eq!(value("comm"), FieldValue::Str(b"sh"));
    assert_eq!(value("cpu"), FieldValue::Number(3));
}

#[test]
fn an_arg_is_found_by_name_when_the_hit_lays_its_args_out_otherwise() {
    let fields = EventFields::new(&args_of("p:g/e f a=%di:u32 b=%si:u32"));
    let b = fields.lookup("b").unwrap();
    let h = hit("sh", 1, 0, vec![("b", ArgValue::Unsigned(7))]);
    assert_eq!(b.value(&h), FieldValue::Number(7));
    let h = hit("sh", 1, 0, vec![("a", ArgValue::Unsigned(7))]);
    assert_eq!(b.value(&h), FieldValue::Missing);
}

#[test]
fn normalize_cuts_to_the_size_and_extends_the_sign() {
    let s8 = FieldType::Number { size: 1, signed: true };
    let u16 = FieldType::Number { size: 2, signed: false };
    assert_eq!(s8.normalize(0xff), u64::MAX);
    assert_eq!(s8.normalize(0x17f), 0x7f);
    assert_eq!(u16.normalize(0x1_0001), 1);
    assert_eq!(FieldType::String.normalize(5), 5);
}

/// A `char` (Linux 6.6+) is an unsigned byte to filters and keys, as in Linux.
#[test]
fn a_char_is_an_unsigned_byte() {
    let fields = EventFields::new(&args_of("p:g/e f c=+0(%di):char"));
    let field = fields.lookup("c").unwrap();
    assert_eq!(field.ty, FieldType::Number { size: 1, signed: false });
    let record = hit("sh", 1, 0, vec![("c", ArgValue::Char(b'A'))]);
    assert_eq!(field.value(&record), FieldValue::Number(65));
}
