//! One writer per ledger: an exclusive advisory lock on a file beside the database, taken
//! before the database is opened. A second instance pointed at the same ledger is refused
//! with a message naming the holder, before it can mark the first one's in-flight rows
//! `unknown` (I4) or write anything at all. The lock goes with the process: a crash
//! releases it, so a restart never has to clean up after one.

use crate::{Error, Result};
use spillway_wire::UnixMs;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// Held for as long as this process writes the ledger.
#[derive(Debug)]
pub struct LedgerLock {
    _file: File,
}

impl LedgerLock {
    /// `<ledger>.lock`.
    pub fn path_for(ledger: &Path) -> PathBuf {
        let mut name = ledger.file_name().map(|n| n.to_os_string()).unwrap_or_default();
        name.push(".lock");
        ledger.with_file_name(name)
    }

    /// Takes the lock for `ledger`, or says who holds it.
    pub fn acquire(ledger: &Path) -> Result<LedgerLock> {
        let path = Self::path_for(ledger);
        let err = |source| Error::Lock {
            path: path.display().to_string(),
            source,
        };
        // Not truncated on open: until the lock is ours, the file names its holder.
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(err)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                return Err(Error::Locked {
                    path: ledger.display().to_string(),
                    holder: if holder.is_empty() {
                        "its holder did not say who it is".to_owned()
                    } else {
                        holder.chars().take(300).collect()
                    },
                });
            }
            Err(TryLockError::Error(e)) => return Err(err(e)),
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "this machine".to_owned());
        let who = format!(
            "spillway {} pid {} on {host}, since {}\n",
            env!("CARGO_PKG_VERSION"),
            std::process::id(),
            UnixMs::from_system(SystemTime::now())
        );
        file.set_len(0).map_err(err)?;
        file.seek(SeekFrom::Start(0)).map_err(err)?;
        file.write_all(who.as_bytes()).map_err(err)?;
        let _ = file.sync_data();
        Ok(LedgerLock { _file: file })
    }
}
