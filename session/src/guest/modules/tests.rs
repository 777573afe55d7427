use super::*;

/// Debian 6.1's cloud kernel, as its modules.dep and modules.builtin say (trimmed).
const DEP: &str = "\
kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio_ring.ko kernel/drivers/virtio/virtio.ko
kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio_ring.ko kernel/drivers/virtio/virtio.ko
kernel/drivers/virtio/virtio_ring.ko:
kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko
kernel/fs/fuse/virtiofs.ko: kernel/fs/fuse/fuse.ko kernel/drivers/virtio/virtio_ring.ko kernel/drivers/virtio/virtio.ko
kernel/fs/fuse/fuse.ko:
kernel/fs/overlayfs/overlay.ko:
kernel/drivers/net/dummy.ko:
";
const BUILTIN: &str = "kernel/fs/ext4/ext4.ko\nkernel/fs/jbd2/jbd2.ko\n";

fn tree(dep: &str, builtin: &str) -> (tempfile::TempDir, ModuleTree) {
    tree_with_softdeps(dep, builtin, None)
}

fn tree_with_softdeps(dep: &str, builtin: &str, softdep: Option<&str>) -> (tempfile::TempDir, ModuleTree) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("modules.dep"), dep).unwrap();
    std::fs::write(dir.path().join("modules.builtin"), builtin).unwrap();
    if let Some(softdep) = softdep {
        std::fs::write(dir.path().join("modules.softdep"), softdep).unwrap();
    }
    for line in dep.lines() {
        let (path, _) = line.split_once(':').unwrap();
        let file = dir.path().join(path);
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(&file, format!("ELF of {path}")).unwrap();
    }
    let tree = ModuleTree::open(dir.path()).unwrap();
    (dir, tree)
}

fn names(order: &[(String, PathBuf)]) -> Vec<&str> {
    order.iter().map(|(n, _)| n.as_str()).collect()
}

#[test]
fn a_distribution_kernel_gets_its_virtio_drivers_dependencies_first_each_once() {
    let (_dir, tree) = tree(DEP, BUILTIN);
    let all = Needs {
        disks: true,
        shares: true,
        shared_root: true,
        disk_root: false,
    };
    let order = tree.resolve(all).unwrap();
    assert_eq!(
        names(&order),
        [
            "virtio_ring",
            "virtio",
            "virtio_mmio",
            "virtio_blk",
            "fuse",
            "virtiofs",
            "overlay"
        ]
    );
    assert_eq!(order[3].1, PathBuf::from("kernel/drivers/block/virtio_blk.ko"));
    // A disk alone: ext4 is built in here, so nothing more.
    let disk = Needs {
        disks: true,
        ..Needs::default()
    };
    assert_eq!(
        names(&tree.resolve(disk).unwrap()),
        ["virtio_ring", "virtio", "virtio_mmio", "virtio_blk"]
    );
    // Nothing needed, nothing loaded.
    assert!(tree.resolve(Needs::default()).unwrap().is_empty());
}

#[test]
fn built_in_drivers_need_nothing_and_a_module_ext4_is_loaded_for_a_root_disk() {
    let builtin = "kernel/drivers/virtio/virtio.ko\nkernel/drivers/virtio/virtio_ring.ko\n\
                   kernel/drivers/virtio/virtio_mmio.ko\n";
    let dep = format!("{DEP}kernel/fs/ext4/ext4.ko: kernel/fs/jbd2/jbd2.ko kernel/fs/mbcache.ko\nkernel/fs/jbd2/jbd2.ko:\nkernel/fs/mbcache.ko:\n");
    let (_dir, tree) = tree(&dep, builtin);
    let order = tree
        .resolve(Needs {
            disks: true,
            disk_root: true,
            ..Needs::default()
        })
        .unwrap();
    assert_eq!(names(&order), ["virtio_blk", "jbd2", "mbcache", "ext4"]);
}

#[test]
fn a_driver_the_kernel_lacks_is_named_with_what_needs_it() {
    let dep: String = DEP
        .lines()
        .filter(|l| !l.contains("virtiofs"))
        .map(|l| format!("{l}\n"))
        .collect();
    let (dir, tree) = tree(&dep, BUILTIN);
    let err = tree
        .resolve(Needs {
            shares: true,
            ..Needs::default()
        })
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        format!(
            "the kernel's module tree {} has no virtiofs (neither built in nor a module): this kernel cannot serve --rootfs or --rwdir",
            dir.path().display()
        )
    );
    let err = ModuleTree::open(&dir.path().join("nowhere")).unwrap_err().to_string();
    assert!(err.contains("not a kernel's module tree (no modules.dep)"), "{err}");
}

#[test]
fn a_dependency_loop_is_an_error_not_a_recursion() {
    let (_dir, tree) = tree(
        "kernel/a/virtio_mmio.ko: kernel/a/x.ko\nkernel/a/x.ko: kernel/a/y.ko\nkernel/a/y.ko: kernel/a/x.ko\n",
        "",
    );
    let err = tree
        .resolve(Needs {
            disks: true,
            ..Needs::default()
        })
        .unwrap_err();
    assert!(matches!(err, ModulesError::Loop { .. }), "{err}");
}

#[test]
fn the_archive_holds_the_modules_numbered_in_order_and_their_load_list() {
    let (_dir, tree) = tree(DEP, BUILTIN);
    let order = tree
        .resolve(Needs {
            disks: true,
            ..Needs::default()
        })
        .unwrap();
    let archive = tree.archive(&order, None).unwrap();
    let text = String::from_utf8_lossy(&archive);
    assert!(text.contains("lib/modules/hvprobe/00-virtio_ring.ko\0"));
    assert!(text.contains("lib/modules/hvprobe/03-virtio_blk.ko\0"));
    assert!(text.contains("ELF of kernel/drivers/block/virtio_blk.ko"));
    assert!(text.contains("00-virtio_ring.ko\n01-virtio.ko\n02-virtio_mmio.ko\n03-virtio_blk.ko\n"));
    assert!(text.ends_with("TRAILER!!!\0\0\0\0") || text.contains("TRAILER!!!"));
}

#[test]
fn module_names_follow_the_kernel_and_compressed_files_keep_their_suffix() {
    assert_eq!(module_name("kernel/drivers/virtio/virtio_mmio.ko.xz"), "virtio_mmio");
    assert_eq!(module_name("kernel/drivers/net/wireguard-x.ko.zst"), "wireguard_x");
    assert_eq!(module_name("virtio.ko"), "virtio");
}

#[test]
fn a_kernel_image_names_its_release() {
    // A bzImage: the setup header's version pointer.
    let mut bz = vec![0u8; 0x400];
    bz[0x202..0x206].copy_from_slice(b"HdrS");
    bz[0x20e..0x210].copy_from_slice(&0x100u16.to_le_bytes());
    let version = b"6.1.0-56-cloud-amd64 (debian-kernel@lists.debian.org) #1 SMP\0";
    bz[0x300..0x300 + version.len()].copy_from_slice(version);
    assert_eq!(kernel_release(&bz).as_deref(), Some("6.1.0-56-cloud-amd64"));
    // An ELF vmlinux: its banner.
    let mut elf = b"\x7fELF........".to_vec();
    elf.extend_from_slice(b"Linux version 6.1.192-hvprobe (hvprobe@hvprobe) (gcc)");
    assert_eq!(kernel_release(&elf).as_deref(), Some("6.1.192-hvprobe"));
    // Nothing, or garbage where the release would be.
    assert_eq!(kernel_release(b"not a kernel"), None);
    bz[0x20e..0x210].copy_from_slice(&0xfff0u16.to_le_bytes());
    assert_eq!(kernel_release(&bz), None);
    let mut odd = b"Linux version ".to_vec();
    odd.extend_from_slice(b"\xff\xfe bad");
    assert_eq!(kernel_release(&odd), None);
}

#[test]
fn soft_dependencies_load_first_and_ext4_goes_with_any_disk() {
    // Arch's way: ext4 a module that wants crc32c first (modules.softdep), which only
    // modprobe would know.
    let dep = format!(
        "{DEP}kernel/fs/ext4/ext4.ko: kernel/fs/jbd2/jbd2.ko\nkernel/fs/jbd2/jbd2.ko:\nkernel/crypto/crc32c_generic.ko:\n"
    );
    let softdep =
        "# Soft dependencies extracted from modules themselves.\nsoftdep ext4 pre: crc32c_generic post: nothing\n";
    let (_dir, tree) = tree_with_softdeps(&dep, "", Some(softdep));
    let order = tree
        .resolve(Needs {
            disks: true,
            ..Needs::default()
        })
        .unwrap();
    assert_eq!(
        names(&order),
        [
            "virtio_ring",
            "virtio",
            "virtio_mmio",
            "virtio_blk",
            "crc32c_generic",
            "jbd2",
            "ext4"
        ]
    );
}

#[test]
fn modules_built_for_another_kernel_are_refused_before_the_boot() {
    let (dir, tree) = tree(DEP, BUILTIN);
    let blk = dir.path().join("kernel/drivers/block/virtio_blk.ko");
    std::fs::write(
        &blk,
        b"\x7fELF...vermagic=6.1.0-55-cloud-amd64 SMP mod_unload modversions \0",
    )
    .unwrap();
    let order = tree
        .resolve(Needs {
            disks: true,
            ..Needs::default()
        })
        .unwrap();
    let err = tree
        .archive(&order, Some("6.1.0-56-cloud-amd64"))
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        format!(
            "--modules {}: virtio_blk is built for kernel 6.1.0-55-cloud-amd64, the kernel is 6.1.0-56-cloud-amd64 (give the module tree of this kernel)",
            dir.path().display()
        )
    );
    assert!(tree.archive(&order, Some("6.1.0-55-cloud-amd64")).is_ok());
    // A module without a vermagic (or a compressed one) is not checked.
    assert!(tree.archive(&order[..3], Some("6.1.0-56-cloud-amd64")).is_ok());
}

#[test]
fn a_kernel_files_release_is_found_past_its_first_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vmlinux");
    // The banner across the 4 MiB boundary a chunked read has.
    let mut image = vec![0u8; (4 << 20) - 6];
    image.extend_from_slice(b"Linux version 6.1.192-hvprobe (hvprobe@hvprobe) #1");
    image.extend_from_slice(&[0u8; 1024]);
    std::fs::write(&path, &image).unwrap();
    assert_eq!(kernel_release_of(&path).unwrap().as_deref(), Some("6.1.192-hvprobe"));
    std::fs::write(&path, b"nothing here").unwrap();
    assert_eq!(kernel_release_of(&path).unwrap(), None);
}
