//! The BTF parser against the host kernel's own BTF (`/sys/kernel/btf/vmlinux`): a big,
//! real input from another kernel than the bundled guest's. A host kernel without BTF
//! (`CONFIG_DEBUG_INFO_BTF`) fails the test with the reason; nothing is skipped.

use hvprobe_introspection::btf::{Btf, TypeData};

#[test]
fn host_kernel_btf_parses() {
    let path = "/sys/kernel/btf/vmlinux";
    let blob = std::fs::read(path).unwrap_or_else(|e| {
        panic!("this test parses the host kernel's BTF, {path}, which cannot be read ({e}): a host kernel without CONFIG_DEBUG_INFO_BTF cannot run it")
    });
    let btf = Btf::parse(&blob).expect("host BTF");
    let comm = btf.member_offset("task_struct", "comm").unwrap();
    let pid = btf.member_offset("task_struct", "pid").unwrap();
    let tgid = btf.member_offset("task_struct", "tgid").unwrap();
    eprintln!("host: {} types, comm {comm:?}, pid {pid:?}", btf.len());
    assert_eq!((comm.size, pid.size, tgid.size), (16, 4, 4));
    assert_eq!(tgid.offset, pid.offset + 4);
    // Every struct/union size must resolve, and every member type must exist.
    for (id, t) in btf.types() {
        if let TypeData::Members(ms) = &t.data {
            btf.type_size(id).unwrap();
            for m in ms {
                btf.resolve(m.type_id).unwrap();
            }
        }
    }
}
