//! hvprobe's cache (`${HVPROBE_CACHE:-$HOME/.cache/hvprobe}`) and what hvprobe itself
//! writes there for the scripts that build into it: the bundled guest (`guest/build.sh`)
//! and virtiofsd (`guest/build-virtiofsd.sh`) run from the build inputs of [`inputs`].

use std::path::PathBuf;

pub mod inputs;

/// hvprobe's cache, `${HVPROBE_CACHE:-$HOME/.cache/hvprobe}` as `guest/build.sh` reads it
/// (an empty variable counts as unset there too).
pub fn cache_dir() -> Option<PathBuf> {
    let nonempty = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    match nonempty("HVPROBE_CACHE") {
        Some(dir) => Some(PathBuf::from(dir)),
        None => Some(PathBuf::from(nonempty("HOME")?).join(".cache/hvprobe")),
    }
}
