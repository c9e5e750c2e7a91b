//! The memory budget: before a large allocation (weights, dummy weights, a KV pool, benchmark
//! buffers) [`check_budget`] compares its size with what the device has free, so a request that
//! cannot fit is an [`Error::OutOfMemory`] naming the request, its size and the limit, instead of
//! an abort ("memory allocation failed"), the OOM killer or a CUDA error deep inside a kernel.
//!
//! What "available" means ([`available`]):
//! - host (Linux): the smallest of `MemAvailable` (`/proc/meminfo`), the cgroup's headroom
//!   (`memory.max − memory.current` at every level of a cgroup v2 hierarchy, or cgroup v1's
//!   `memory.limit_in_bytes − memory.usage_in_bytes`), and the headroom under the process's soft
//!   `RLIMIT_AS` (`ulimit -v`, against `VmSize`) and `RLIMIT_DATA` (against `VmData`). Elsewhere the
//!   host is not checked.
//! - CUDA: the device's free memory (`cuMemGetInfo`) plus what the stream-ordered pool holds
//!   freed and ready for reuse.
//!
//! The check is a guard, not a reservation: two requests checked one after the other may each
//! fit alone. Callers check the whole of what they are about to allocate (the sum of a model's
//! weights, a pool's size), before allocating it.

use crate::{Device, Error, Result};

/// Free memory on a device and which limit set it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Available {
    pub bytes: usize,
    /// The limit that is the smallest, e.g. `MemAvailable`, `RLIMIT_AS`, `cgroup memory.max`,
    /// `cuMemGetInfo`; `unknown` where nothing could be read (then `bytes` is `usize::MAX`).
    pub limit: &'static str,
}

/// What `device` has free now (see the module docs).
pub fn available(device: Device) -> Result<Available> {
    match device {
        Device::Cpu => Ok(host_available()),
        Device::Cuda(i) => Ok(Available {
            bytes: crate::cuda::cuda_backend(i)?.free_memory()?,
            limit: "cuMemGetInfo free + pooled",
        }),
    }
}

/// `Ok` when `bytes` fit in what `device` has free, else [`Error::OutOfMemory`] naming
/// `request` (what the memory is for, e.g. "dummy weights `lm_head.weight` [32000, 4096] bf16"),
/// `bytes` and the limit.
pub fn check_budget(request: &str, bytes: usize, device: Device) -> Result<()> {
    let avail = available(device)?;
    if bytes > avail.bytes {
        return Err(Error::OutOfMemory {
            request: request.to_string(),
            bytes,
            available: avail.bytes,
            limit: avail.limit,
            device,
        });
    }
    Ok(())
}

/// `bytes` for people: `1.50 GiB`, `12.0 MiB`, `512 B`.
pub fn human_bytes(bytes: usize) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    let prec = if v < 10.0 { 2 } else { 1 };
    format!("{v:.prec$} {}", UNITS[unit])
}

#[cfg(target_os = "linux")]
fn host_available() -> Available {
    let mut best = Available {
        bytes: usize::MAX,
        limit: "unknown",
    };
    let mut consider = |bytes: Option<u64>, limit: &'static str| {
        if let Some(b) = bytes {
            let b = usize::try_from(b).unwrap_or(usize::MAX);
            if b < best.bytes {
                best = Available { bytes: b, limit };
            }
        }
    };
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    consider(kib_field(&meminfo, "MemAvailable:"), "MemAvailable");
    consider(cgroup_v2_headroom(), "cgroup memory.max");
    consider(cgroup_v1_headroom(), "cgroup memory.limit_in_bytes");
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    for (row, used, name) in [
        ("Max address space", "VmSize:", "RLIMIT_AS (ulimit -v)"),
        ("Max data size", "VmData:", "RLIMIT_DATA (ulimit -d)"),
    ] {
        if let (Some(limit), Some(used)) = (soft_limit(&limits, row), kib_field(&status, used)) {
            consider(Some(limit.saturating_sub(used)), name);
        }
    }
    best
}

#[cfg(not(target_os = "linux"))]
fn host_available() -> Available {
    Available {
        bytes: usize::MAX,
        limit: "unknown",
    }
}

/// `Key:   123 kB` → 123 · 1024.
fn kib_field(text: &str, key: &str) -> Option<u64> {
    let rest = text.lines().find_map(|l| l.strip_prefix(key))?;
    let kib: u64 = rest.split_whitespace().next()?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The soft limit of `/proc/self/limits`' row `name` in bytes; `None` when unlimited.
fn soft_limit(limits: &str, name: &str) -> Option<u64> {
    let rest = limits.lines().find_map(|l| l.strip_prefix(name))?;
    rest.split_whitespace().next()?.parse().ok()
}

/// min over the cgroup v2 hierarchy of this process of `memory.max − memory.current`.
#[cfg(target_os = "linux")]
fn cgroup_v2_headroom() -> Option<u64> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = cgroups.lines().find_map(|l| l.strip_prefix("0::"))?;
    let mut dir = std::path::Path::new("/sys/fs/cgroup").join(rel.trim_start_matches('/'));
    let mut best: Option<u64> = None;
    loop {
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
        if let (Some(max), Some(cur)) = (read("memory.max"), read("memory.current"))
            && let (Ok(max), Ok(cur)) = (max.trim().parse::<u64>(), cur.trim().parse::<u64>())
        {
            let room = max.saturating_sub(cur);
            best = Some(best.map_or(room, |b| b.min(room)));
        }
        if dir == std::path::Path::new("/sys/fs/cgroup") || !dir.pop() {
            break;
        }
    }
    best
}

/// cgroup v1: `memory.limit_in_bytes − memory.usage_in_bytes` (no limit reads as a huge number).
#[cfg(target_os = "linux")]
fn cgroup_v1_headroom() -> Option<u64> {
    let dir = std::path::Path::new("/sys/fs/cgroup/memory");
    let read = |f: &str| -> Option<u64> {
        std::fs::read_to_string(dir.join(f))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    Some(read("memory.limit_in_bytes")?.saturating_sub(read("memory.usage_in_bytes")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_files() {
        let meminfo = "MemTotal:       24000000 kB\nMemAvailable:   16000000 kB\n";
        assert_eq!(kib_field(meminfo, "MemAvailable:"), Some(16_000_000 * 1024));
        assert_eq!(kib_field(meminfo, "Nope:"), None);
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max data size             unlimited            unlimited            bytes     \n\
                      Max address space         1073741824           unlimited            bytes     \n";
        assert_eq!(soft_limit(limits, "Max address space"), Some(1 << 30));
        assert_eq!(soft_limit(limits, "Max data size"), None);
    }

    #[test]
    fn human_bytes_picks_a_unit() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.50 KiB");
        assert_eq!(human_bytes(200 << 30), "200.0 GiB");
    }

    #[test]
    fn a_request_beyond_the_host_is_refused_with_its_size_and_the_limit() {
        let avail = available(Device::Cpu).unwrap();
        assert!(avail.bytes > 0);
        check_budget("a small buffer", 4096, Device::Cpu).unwrap();
        let e = check_budget("bench buffers `x` [9, 9]", usize::MAX, Device::Cpu);
        if avail.bytes == usize::MAX {
            // A host where no limit could be read (not Linux): nothing is refused.
            assert!(e.is_ok());
            return;
        }
        let e = e.unwrap_err().to_string();
        assert!(e.starts_with("bench buffers `x` [9, 9]: needs "), "{e}");
        assert!(e.contains(&format!("({} bytes)", usize::MAX)), "{e}");
        assert!(e.contains(avail.limit), "{e}");
    }
}
