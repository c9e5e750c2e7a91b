//! Opening model files: regular files only, without blocking on a FIFO, size-bounded reads.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use crate::{Error, Result};

/// What is at a path, for the regular-file checks.
pub(super) enum Entry {
    Missing,
    Regular,
    /// Something else: "a directory", "a FIFO (named pipe)", ...
    Other(&'static str),
}

pub(super) fn entry(path: &Path) -> std::io::Result<Entry> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::metadata(path) {
        Ok(m) => {
            let t = m.file_type();
            Ok(if t.is_file() {
                Entry::Regular
            } else if t.is_dir() {
                Entry::Other("a directory")
            } else if t.is_fifo() {
                Entry::Other("a FIFO (named pipe)")
            } else if t.is_socket() {
                Entry::Other("a socket")
            } else if t.is_block_device() || t.is_char_device() {
                Entry::Other("a device")
            } else {
                Entry::Other("not a regular file")
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Entry::Missing),
        Err(e) => Err(e),
    }
}

pub(super) fn not_regular(path: &Path, what: &str, kind: &str) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        err: std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{what} must be a regular file, but this is {kind}"),
        ),
    }
}

/// Opens `path` for reading if it is a regular file (`what` names it in errors, e.g.
/// "config.json"). The open itself is non-blocking, so a FIFO swapped in after the check cannot
/// hang it, and the opened file is checked again (`fstat`).
pub fn open_regular(path: &Path, what: &str) -> Result<File> {
    let io = |err| Error::Io {
        path: path.to_path_buf(),
        err,
    };
    if let Entry::Other(kind) = entry(path).map_err(io)? {
        return Err(not_regular(path, what, kind));
    }
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(io)?;
    if !file.metadata().map_err(io)?.is_file() {
        return Err(not_regular(path, what, "not a regular file"));
    }
    Ok(file)
}

/// The contents of the regular file `path`, at most `max_bytes` of them (a larger file is an
/// error naming the limit, not a large allocation).
pub fn read_regular_file(path: &Path, what: &str, max_bytes: u64) -> Result<Vec<u8>> {
    let file = open_regular(path, what)?;
    let io = |err| Error::Io {
        path: path.to_path_buf(),
        err,
    };
    let len = file.metadata().map_err(io)?.len();
    let too_big = |len: u64| Error::Io {
        path: path.to_path_buf(),
        err: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{what} is {len} bytes, more than the {max_bytes} read"),
        ),
    };
    if len > max_bytes {
        return Err(too_big(len));
    }
    let mut out = Vec::with_capacity(len as usize);
    // `take` guards a file that grows between the size check and the read.
    file.take(max_bytes + 1).read_to_end(&mut out).map_err(io)?;
    if out.len() as u64 > max_bytes {
        return Err(too_big(out.len() as u64));
    }
    Ok(out)
}
