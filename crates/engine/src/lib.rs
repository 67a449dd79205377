//! The pure engine: per-conversation state and its fold ([`state`]), the rules ([`rules`]) and
//! what deciding takes and yields ([`decide`]), the one step that folds an event and decides for
//! it ([`fold::fold_and_decide`]), and the loops around it: a fold job's batch ([`batch`]: reads
//! through [`batch::FoldReads`], a [`batch::WriteSet`] out for the store to commit), and
//! conversations rebuilt from their stored events for a replay and the audit ([`replay`]). What the
//! store's indexes derive from a state is named in [`index`]. Event, state and clock in;
//! decisions and writes out. No runtime, no storage, no network: its dependency tree has no
//! tokio, sled, actix or awc (`cargo tree -p engine -e normal`).

pub mod batch;
pub mod decide;
pub mod fold;
pub mod index;
pub mod replay;
pub mod rules;
pub mod state;
