//! The bundled guest's build inputs, embedded by this crate's `build.rs` (and so in the
//! `hvprobe` binary) and written into the cache (`$HVPROBE_CACHE/guest-inputs/KEY/`, KEY a
//! hash of them) where `guest/build.sh` runs from them: an installed or copied hvprobe
//! builds its guest with no checkout. The script keys its artefacts by the inputs' contents
//! and relative paths, so the guest it builds from here is the one a checkout's
//! `guest/build.sh` builds.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

include!(concat!(env!("OUT_DIR"), "/guest_inputs.rs"));

/// Why the inputs could not be written into the cache.
#[derive(Debug, thiserror::Error)]
#[error("cannot write the bundled guest's build inputs at {path}: {source}")]
pub struct InputsError {
    path: PathBuf,
    #[source]
    source: std::io::Error,
}

/// Marks a directory whose inputs were all written (they are written into a temporary
/// directory that is then renamed, so a directory with it is whole).
const COMPLETE: &str = ".complete";

/// The directory under `cache` holding the embedded inputs, written if it is missing.
pub fn ensure_written(cache: &Path) -> Result<PathBuf, InputsError> {
    let parent = cache.join("guest-inputs");
    let dir = parent.join(key());
    if dir.join(COMPLETE).exists() {
        return Ok(dir);
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| InputsError { path, source }
    };
    std::fs::create_dir_all(&parent).map_err(io(&parent))?;
    let tmp = parent.join(format!(".tmp-{}-{}", key(), std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    for (name, contents) in GUEST_INPUTS {
        let file = tmp.join(name);
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir).map_err(io(dir))?;
        }
        std::fs::write(&file, contents).map_err(io(&file))?;
    }
    std::fs::write(tmp.join(COMPLETE), b"").map_err(io(&tmp))?;
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        // Another hvprobe wrote the same inputs first: theirs are as good.
        Err(_) if dir.join(COMPLETE).exists() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(source) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Err(InputsError { path: dir, source })
        }
    }
}

/// A hash of the inputs' names and contents.
fn key() -> String {
    let mut hash = Sha256::new();
    for (name, contents) in GUEST_INPUTS {
        hash.update((name.len() as u64).to_le_bytes());
        hash.update(name.as_bytes());
        hash.update((contents.len() as u64).to_le_bytes());
        hash.update(contents);
    }
    hash.finalize()[..8].iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_inputs_are_the_checkouts_guest_files() {
        let guest = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("guest");
        let names: Vec<&str> = GUEST_INPUTS.iter().map(|(name, _)| *name).collect();
        for needed in [
            "build.sh",
            "kernel/config.fragment",
            "kernel/cmdline",
            "init/hvprobe-init.c",
        ] {
            assert!(names.contains(&needed), "{needed} is not embedded: {names:?}");
        }
        for (name, contents) in GUEST_INPUTS {
            assert_eq!(&std::fs::read(guest.join(name)).unwrap(), contents, "{name}");
        }
    }

    #[test]
    fn inputs_are_written_once_whole_and_found_again() {
        let cache = std::env::temp_dir().join(format!("hvprobe-inputs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&cache);
        let dir = ensure_written(&cache).unwrap();
        assert!(dir.join(COMPLETE).exists());
        for (name, contents) in GUEST_INPUTS {
            assert_eq!(&std::fs::read(dir.join(name)).unwrap(), contents, "{name}");
        }
        assert_eq!(ensure_written(&cache).unwrap(), dir);
        let leftovers: Vec<_> = std::fs::read_dir(cache.join("guest-inputs"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n.to_string_lossy().starts_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
        std::fs::remove_dir_all(&cache).unwrap();
    }
}
