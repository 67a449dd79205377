//! Pages of the admin lists that have no reader of their own elsewhere: the end users in id
//! order and the finished entries newest first. Each reads one page with a sled `range` from its
//! cursor, never a whole tree (the conversations' pages are `Store::conversations_page`, the
//! sweeper's sample).

use super::{decode, keys, Store, StoreError};
use crate::actions::DoneRecord;
use crate::state::EndUserState;

impl Store {
    /// At most `limit` end users with ids after `after` (from the first when `None`), in id
    /// order.
    pub fn end_users_page(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<EndUserState>, StoreError> {
        let iter = match after {
            Some(id) => {
                let mut from = id.as_bytes().to_vec();
                from.push(0);
                self.end_users.range(from..)
            }
            None => self.end_users.iter(),
        };
        iter.take(limit)
            .map(|item| decode(&item?.1, "end-user state"))
            .collect()
    }

    /// At most `limit` finished entries (done or dropped) with seqs below `before` (from the
    /// newest when `None`), newest first: the ledger's records are keyed by their entry's seq.
    pub fn finished_page(
        &self,
        before: Option<u64>,
        limit: usize,
    ) -> Result<Vec<DoneRecord>, StoreError> {
        let iter = match before {
            Some(seq) => self.done.range(..keys::seq(seq)),
            None => self.done.iter(),
        };
        iter.rev()
            .take(limit)
            .map(|item| decode(&item?.1, "finished entry"))
            .collect()
    }
}
