//! Shared pieces of the StrataFlux command-line tools (`sfx`, `sfx-run`, `sfx-convert`): device
//! selection, opening checkpoints, and the `sfx bench` / `sfx test-backend` / `sfx tune` / `sfx publish` commands. The tools stay thin; the work
//! is in the `sfx-formats`, `sfx-calibration` and `sfx-runtime` crates.

pub mod bench;
pub mod device;
pub mod heldout;
pub mod mapped;
pub mod model_open;
pub mod publish;
pub mod quality;
pub mod resume;
pub mod soak;
pub mod test_backend;
pub mod tune;
