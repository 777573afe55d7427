use std::os::unix::fs::PermissionsExt;

use super::*;

/// A scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hvprobe-shares-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn rwdir(text: &str) -> RwDir {
    let (guest_path, host) = match text.split_once('=') {
        Some((g, h)) => (Some(g.to_owned()), h),
        None => (None, text),
    };
    RwDir {
        arg: text.to_owned(),
        guest_path,
        host_dir: host.into(),
    }
}

/// A stand-in for virtiofsd: a shell script with `body` (its arguments are virtiofsd's:
/// `$2` is the socket path).
fn fake_daemon(dir: &Path, body: &str) -> PathBuf {
    let path = dir.join("fake-virtiofsd");
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

fn alive(pid: u32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as i32, 0) == 0 }
}

#[test]
fn shares_get_their_tags_and_init_options_in_order() {
    let dir = scratch("tags");
    let (a, b) = (dir.join("a"), dir.join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let a_canon = std::fs::canonicalize(&a).unwrap();
    let shares = shares(
        Some(&dir),
        &[],
        &[rwdir(&format!("/data={}", a.display())), rwdir(b.to_str().unwrap())],
    )
    .unwrap();
    let options: Vec<String> = shares.iter().map(Share::cmdline_option).collect();
    let b_canon = std::fs::canonicalize(&b).unwrap();
    assert_eq!(
        options,
        [
            "hvprobe.rootfs=hvprobe-rootfs".to_owned(),
            "hvprobe.rwdir=hvprobe-rw0:/data".to_owned(),
            format!("hvprobe.rwdir=hvprobe-rw1:{}", b_canon.display()),
        ]
    );
    assert!(shares[0].read_only && !shares[1].read_only && !shares[2].read_only);
    assert_eq!(shares[1].host_dir, a_canon);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_shares_are_refused_with_their_reason() {
    let dir = scratch("bad");
    let file = dir.join("file");
    std::fs::write(&file, b"").unwrap();
    let d = dir.to_str().unwrap();
    let missing = dir.join("missing");
    let cases: Vec<(Option<&Path>, Vec<String>, String)> = vec![
        (
            Some(&missing),
            vec![],
            format!("--rootfs {}: No such file or directory", missing.display()),
        ),
        (
            Some(&file),
            vec![],
            format!("--rootfs {}: not a directory", file.display()),
        ),
        (
            None,
            vec![file.display().to_string()],
            format!("--rwdir {}: not a directory", file.display()),
        ),
        (
            None,
            vec![format!("data={d}")],
            "the guest path \"data\" must be absolute".into(),
        ),
        (
            None,
            vec![format!("/my data={d}")],
            "holds white space, which the kernel command line cannot carry".into(),
        ),
        (None, vec![format!("/a,b={d}")], "holds a comma".into()),
        (None, vec![format!("/a:b={d}")], "holds a colon".into()),
        (
            None,
            vec![format!("/={d}")],
            "the guest's / is --rootfs DIR's to share".into(),
        ),
        (
            None,
            vec![format!("/x={d}"), format!("/x/={d}")],
            "--rwdir: the guest path /x is given twice".into(),
        ),
    ];
    for (rootfs, rwdirs, message) in cases {
        let args: Vec<RwDir> = rwdirs.iter().map(|r| rwdir(r)).collect();
        let err = shares(rootfs, &[], &args).expect_err("refused").to_string();
        assert!(err.contains(&message), "{rootfs:?} {rwdirs:?}: {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn virtiofsd_gets_its_socket_the_directory_and_read_only_for_the_root() {
    let share = Share {
        host_dir: "/srv/root".into(),
        tag: ROOTFS_TAG.into(),
        guest_path: None,
        read_only: true,
        hidden: hidden_paths(&[]).unwrap(),
    };
    let owner = Owner { uid: 1000, gid: 100 };
    let args: Vec<String> = virtiofsd_args(
        &share,
        Path::new("/srv/root"),
        Path::new("/run/s.sock"),
        &Sandbox::Namespace,
        owner,
    )
    .iter()
    .map(|a| a.to_string_lossy().into_owned())
    .collect();
    assert_eq!(
        args,
        [
            "--socket-path",
            "/run/s.sock",
            "--shared-dir",
            "/srv/root",
            "--sandbox=namespace",
            "--cache=auto",
            "--log-level=warn",
            "--thread-pool-size=0",
            "--modcaps=-mknod:-setfcap:-fsetid",
            "--inode-file-handles=never",
            "--translate-uid=map:0:1000:1",
            "--translate-uid=squash-guest:1:1000:4294967294",
            "--translate-gid=map:0:100:1",
            "--translate-gid=squash-guest:1:100:4294967294",
            "--readonly",
            "--no-announce-submounts"
        ]
    );
    let rw = Share {
        read_only: false,
        guest_path: Some("/data".into()),
        tag: "hvprobe-rw0".into(),
        hidden: Vec::new(),
        ..share
    };
    let args = virtiofsd_args(&rw, &rw.host_dir, Path::new("/run/s.sock"), &Sandbox::None, owner);
    assert!(args.iter().any(|a| a == "--sandbox=none"));
    assert!(!args.iter().any(|a| a == "--readonly"));
    assert!(!args.iter().any(|a| a == "--no-announce-submounts"));
    // Never extended attributes (security.capability), ACLs or security labels.
    assert!(!args
        .iter()
        .any(|a| a.to_string_lossy().contains("xattr") || a.to_string_lossy().contains("acl")));
}

/// The real virtiofsd takes every argument hvprobe gives it (a typo would end it at its
/// start, with its usage, in every run): it is started with them and creates its socket.
#[test]
fn the_real_virtiofsd_takes_the_arguments() {
    let Ok((binary, _)) = find_virtiofsd(None) else {
        panic!("this test runs virtiofsd: build it (guest/build-virtiofsd.sh) or set HVPROBE_VIRTIOFSD");
    };
    let dir = scratch("real");
    let share = Share {
        host_dir: dir.clone(),
        tag: "hvprobe-rw0".into(),
        guest_path: Some("/data".into()),
        read_only: false,
        hidden: Vec::new(),
    };
    let daemons = Daemons::start(&binary, &Sandbox::Namespace, &[share], &dir, SOCKET_DEADLINE).unwrap();
    // It applies its capabilities after its socket exists: a vhost-user GET_FEATURES
    // answered (request 1, version 1, no payload) says it got past them.
    let socket = &daemons.fs_configs()[0].socket;
    // Its socket file exists from its bind, a moment before it listens (the VMM's
    // connection waits the same way).
    let mut stream = hvprobe_vmm::virtio::fs::connect_listening(socket, Duration::from_secs(10)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    use std::io::{Read, Write};
    stream.write_all(&[1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]).unwrap();
    let mut reply = [0u8; 20];
    stream.read_exact(&mut reply).unwrap_or_else(|e| {
        panic!(
            "virtiofsd did not answer ({e}): {:?}",
            daemons.death().map(|d| d.to_string())
        )
    });
    assert_eq!(&reply[..4], &[1, 0, 0, 0], "{reply:?}");
    drop(stream);
    drop(daemons);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_hide_list_is_the_default_unless_told_and_none_goes_alone() {
    let defaults: Vec<PathBuf> = DEFAULT_HIDDEN.iter().map(PathBuf::from).collect();
    assert_eq!(hidden_paths(&[]).unwrap(), defaults);
    assert_eq!(hidden_paths(&[RootfsHide::Default]).unwrap(), defaults);
    assert!(hidden_paths(&[RootfsHide::Nothing]).unwrap().is_empty());
    let mine = RootfsHide::Path("/srv/keys".into());
    assert_eq!(
        hidden_paths(std::slice::from_ref(&mine)).unwrap(),
        [PathBuf::from("/srv/keys")]
    );
    let both = hidden_paths(&[RootfsHide::Default, mine.clone()]).unwrap();
    assert_eq!(both.len(), defaults.len() + 1);
    assert!(both.contains(&PathBuf::from("/etc/shadow")) && both.contains(&PathBuf::from("/srv/keys")));
    let err = hidden_paths(&[RootfsHide::Nothing, mine]).unwrap_err().to_string();
    assert_eq!(
        err,
        "--rootfs-hide none hides nothing, so it goes alone (not with /srv/keys)"
    );
    // Only the root share hides.
    let dir = scratch("hide-list");
    let shares = shares(Some(&dir), &[], &[rwdir(&format!("/data={}", dir.display()))]).unwrap();
    assert_eq!(shares[0].hidden, defaults);
    assert!(shares[1].hidden.is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_refused_sandbox_is_an_error_unless_given_up_and_hiding_needs_namespaces() {
    let refused = || {
        Some(NamespacesRefused::Unshare {
            root: false,
            source: std::io::Error::from_raw_os_error(libc::EPERM),
        })
    };
    let rw = Share {
        host_dir: "/srv/data".into(),
        tag: "hvprobe-rw0".into(),
        guest_path: Some("/data".into()),
        read_only: false,
        hidden: Vec::new(),
    };
    let root = Share {
        host_dir: "/".into(),
        tag: ROOTFS_TAG.into(),
        guest_path: None,
        read_only: true,
        hidden: vec!["/etc/shadow".into()],
    };
    let err = choose_sandbox(None, refused(), std::slice::from_ref(&rw))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("virtiofsd's namespace sandbox cannot be made here: this host refuses to create the namespaces virtiofsd's sandbox needs as a user other than root"),
        "{err}"
    );
    assert!(err.contains("pass --share-sandbox none"), "{err}");
    assert!(choose_sandbox(Some(Sandbox::Namespace), refused(), std::slice::from_ref(&rw)).is_err());
    assert_eq!(
        choose_sandbox(Some(Sandbox::None), refused(), std::slice::from_ref(&rw)).unwrap(),
        Sandbox::None
    );
    let err = choose_sandbox(Some(Sandbox::None), refused(), &[root.clone(), rw])
        .unwrap_err()
        .to_string();
    assert!(err.contains("pass --rootfs-hide none to share all of /"), "{err}");
    assert_eq!(
        choose_sandbox(None, None, std::slice::from_ref(&root)).unwrap(),
        Sandbox::Namespace
    );
    assert_eq!(
        choose_sandbox(Some(Sandbox::None), None, &[root]).unwrap(),
        Sandbox::None
    );
}

#[test]
fn a_program_that_is_not_virtiofsd_is_refused() {
    let dir = scratch("check");
    let fake = fake_daemon(&dir, "echo 'something 2.0'");
    let err = check_virtiofsd(&fake, "--virtiofsd").unwrap_err().to_string();
    assert!(err.contains("is it virtiofsd?"), "{err}");
    let err = check_virtiofsd(&dir.join("nothing"), "--virtiofsd")
        .unwrap_err()
        .to_string();
    assert!(err.contains("cannot be run: No such file or directory"), "{err}");
    let real_enough = fake_daemon(&dir, "echo 'virtiofsd 1.14.0'");
    // The namespace probe runs it too; either outcome is a sandbox choice, not an error.
    check_virtiofsd(&real_enough, "--virtiofsd").unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

fn one_share(dir: &Path) -> Vec<Share> {
    vec![Share {
        host_dir: dir.into(),
        tag: "hvprobe-rw0".into(),
        guest_path: Some("/data".into()),
        read_only: false,
        hidden: Vec::new(),
    }]
}

#[test]
fn a_daemon_is_started_with_its_socket_and_stopped_and_reaped_at_the_end() {
    let dir = scratch("life");
    let args_file = dir.join("args");
    let fake = fake_daemon(
        &dir,
        &format!("echo \"$@\" > {}; touch \"$2\"; exec sleep 600", args_file.display()),
    );
    let daemons = Daemons::start(&fake, &Sandbox::Namespace, &one_share(&dir), &dir, SOCKET_DEADLINE).unwrap();
    let pid = daemons.pids()[0];
    let configs = daemons.fs_configs();
    assert_eq!(configs.len(), 1);
    assert_eq!(configs[0].tag, "hvprobe-rw0");
    let socket_dir = configs[0].socket.parent().unwrap().to_owned();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(&socket_dir).unwrap().mode() & 0o777, 0o700);
    let args = std::fs::read_to_string(&args_file).unwrap();
    assert!(
        args.starts_with(&format!(
            "--socket-path {} --shared-dir {}",
            configs[0].socket.display(),
            dir.display()
        )),
        "{args}"
    );
    assert!(alive(pid));
    drop(daemons);
    // Reaped (not even a zombie is left) and its socket directory gone.
    assert!(!alive(pid), "the daemon {pid} outlived its run");
    assert!(!socket_dir.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_daemon_that_fails_to_start_is_reported_with_its_status_and_last_words() {
    let dir = scratch("fail");
    let fake = fake_daemon(&dir, "echo 'Error entering sandbox: EPERM' >&2; exit 3");
    let err = Daemons::start(&fake, &Sandbox::Namespace, &one_share(&dir), &dir, SOCKET_DEADLINE)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains(" for --rwdir /data="), "{err}");
    assert!(
        err.contains("died before the guest booted: exited with status 3"),
        "{err}"
    );
    assert!(err.contains("Error entering sandbox: EPERM"), "{err}");

    let silent = fake_daemon(&dir, "echo 'still thinking' >&2; exec sleep 600");
    let started = Instant::now();
    let err = Daemons::start(
        &silent,
        &Sandbox::Namespace,
        &one_share(&dir),
        &dir,
        Duration::from_millis(300),
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(err.contains("did not create its socket within"), "{err}");
    assert!(err.contains("still thinking"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5), "the deadline was not kept");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_daemon_that_dies_while_the_guest_runs_is_reported_once_and_a_stopped_one_is_not() {
    let dir = scratch("death");
    // It speaks before its socket appears: what it said is there when it is killed.
    let fake = fake_daemon(&dir, "echo 'serving' >&2; touch \"$2\"; exec sleep 600");
    let daemons = Daemons::start(&fake, &Sandbox::Namespace, &one_share(&dir), &dir, SOCKET_DEADLINE).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = Mutex::new(tx);
    daemons.on_death(Box::new(move |died| {
        tx.lock().unwrap().send(died.clone()).unwrap();
        true
    }));
    let pid = daemons.pids()[0];
    // SAFETY: kill(2) on the daemon this test started.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let died = rx.recv_timeout(Duration::from_secs(10)).expect("the death was seen");
    assert_eq!(died.pid, pid);
    assert_eq!(died.status, "was killed by signal 9");
    // Recorded once the callback (which sent it) has returned.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let text = loop {
        match daemons.death() {
            Some(died) => break died.to_string(),
            None if std::time::Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            None => panic!("the death was reported but never recorded"),
        }
    };
    assert!(
        text.contains("died while the guest ran: was killed by signal 9"),
        "{text}"
    );
    assert!(text.contains("serving"), "{text}");
    drop(daemons);
    assert!(rx.try_recv().is_err(), "reported twice");

    // Stopped by hvprobe: no death.
    let daemons = Daemons::start(&fake, &Sandbox::Namespace, &one_share(&dir), &dir, SOCKET_DEADLINE).unwrap();
    daemons.on_death(Box::new(|_| panic!("a stopped daemon is no death")));
    drop(daemons);
    std::fs::remove_dir_all(&dir).unwrap();
}
