//! The pure engine: per-conversation state and its fold ([`state`]), the rules ([`rules`]) and
//! what deciding takes and yields ([`decide`]), and the one path that folds an event and decides
//! for it ([`fold::fold_and_decide`]). Event, state and clock in; decisions out. No
//! runtime, no storage, no network: its dependency tree has no tokio, sled, actix or awc
//! (`cargo tree -p engine`).

pub mod decide;
pub mod fold;
pub mod rules;
pub mod state;
