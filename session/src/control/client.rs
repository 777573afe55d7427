//! The client side of the control socket: finding a run's socket and talking to it (the
//! commands that do are `hvprobe probe` and `hvprobe trace`).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use super::{default_socket_dir, ControlError, Request, Response};

/// The environment variable that names the control socket when `--control` does not.
pub const CONTROL_ENV: &str = "HVPROBE_CONTROL";

/// The socket to talk to: `--control`, else `$HVPROBE_CONTROL`, else the one live socket
/// in the default directory.
pub fn find_socket(given: Option<&Path>) -> Result<PathBuf, ControlError> {
    if let Some(path) = given {
        return Ok(path.to_path_buf());
    }
    if let Some(path) = std::env::var_os(CONTROL_ENV).filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(path));
    }
    let dir = default_socket_dir();
    let mut live: Vec<PathBuf> = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "sock") && UnixStream::connect(p).is_ok())
        .collect();
    live.sort();
    match live.len() {
        0 => Err(ControlError::NoneRunning { dir }),
        1 => Ok(live.remove(0)),
        _ => Err(ControlError::SeveralRunning { sockets: live }),
    }
}

/// A connection to a run's control socket.
pub struct Connection {
    path: PathBuf,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Connection {
    pub fn open(given: Option<&Path>) -> Result<Connection, ControlError> {
        let path = find_socket(given)?;
        let io = |source| ControlError::Io {
            path: path.clone(),
            source,
        };
        let writer = UnixStream::connect(&path).map_err(io)?;
        let reader = BufReader::new(writer.try_clone().map_err(io)?);
        Ok(Connection { path, reader, writer })
    }

    /// Sends one request and reads its answer.
    pub fn request(&mut self, request: &Request) -> Result<Response, ControlError> {
        let io = |source| ControlError::Io {
            path: self.path.clone(),
            source,
        };
        let mut line = serde_json::to_string(request).map_err(|source| ControlError::Protocol {
            path: self.path.clone(),
            source,
        })?;
        // The server would answer only that it is too long, and hang up.
        if line.len() > super::MAX_REQUEST_BYTES {
            return Err(ControlError::RequestTooLong {
                path: self.path.clone(),
                bytes: line.len(),
                max: super::MAX_REQUEST_BYTES,
            });
        }
        line.push('\n');
        self.writer.write_all(line.as_bytes()).map_err(io)?;
        let mut answer = String::new();
        if self.reader.read_line(&mut answer).map_err(io)? == 0 {
            return Err(ControlError::Closed {
                path: self.path.clone(),
            });
        }
        serde_json::from_str(&answer).map_err(|source| ControlError::Protocol {
            path: self.path.clone(),
            source,
        })
    }

    /// Reads the next line the run sends (a streamed event); 0 at the end of the stream.
    pub fn read_line(&mut self, line: &mut String) -> Result<usize, ControlError> {
        self.reader.read_line(line).map_err(|source| ControlError::Io {
            path: self.path.clone(),
            source,
        })
    }

    /// Whether lines already received wait to be read (no need to flush before them).
    pub fn has_buffered(&self) -> bool {
        !self.reader.buffer().is_empty()
    }
}
