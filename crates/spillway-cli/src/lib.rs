//! The start-up path that `spillway serve` and the desktop shell share: read the config
//! (or the embedded default, `policies/demo.yaml`), start the simulated providers it asks
//! for, open the ledger, start the engine with the console compiled into this binary, and
//! start demo traffic; then stop it all in order on shutdown. The engine library knows
//! nothing of the simulator or the demo: they are wired in here.

// The package's lint is `deny` (see Cargo.toml): one call into the allocator's C API, in
// `memory`, is allowed at that line and nowhere else.
#![deny(unsafe_code)]

pub mod launch;
pub mod memory;
pub mod signals;
pub mod status;

pub use launch::{Launch, LaunchError, Launched};
