//! Selective weight refinement at decode time (docs/method.md §2–4): per-token channel
//! selection, the tiers that hold the refinement (RAM map, SSD through a bounded cache) and the
//! engine that adds the fetched refinement to the resident projections.

pub mod engine;
pub mod fault;
pub mod open;
mod placed;
pub mod plan;
pub mod select;
pub mod store;

pub use engine::bundle_budget;
pub use engine::{MlpMode, RefineCounters, RefineSettings, RefinementPlan, Refiner};
pub use open::{open_refinement, RefineOpenOptions, TierChoice};
pub use plan::{
    bundles_section, columns_section, file_budgets, file_ladder, file_settings, ladder_rung,
    plan_from_sfx, refinement_payload,
};
pub use store::MissPolicy;
