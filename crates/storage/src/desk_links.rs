//! The desks' mappings (`desk_links/v1`), a port group of its own ([`DeskLinks`]): for each
//! connector, a service conversation's conversation at the desk (and how far the bridge got
//! opening and filling it), the desk's conversation back to the service's (its webhook names
//! only its own), and the desk's contact of an end user. Connectors write them as they go, so a
//! retry after a crash or an uncertain failure resumes instead of doing a call twice.
//!
//! Keys (`keys::desk_link`): `l` connector, conversation -> [`DeskLink`]; `r` connector, the
//! desk's conversation -> the service's conversation id; `u` connector, end user -> a
//! [`DeskContact`]. A link and its `r` entries are written in one batch. Opened by name on use
//! (sled keeps opened trees), not kept in [`SledStore`].

use super::{decode, encode, keys, SledStore, StoreError};
use model::ids::ConversationId;
use model::webhook::model::Millis;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// What a link keeps of what was posted (bridge-owned ids, newest last).
pub const POSTED_KEPT: usize = 500;
/// Earlier desk conversations a link remembers.
pub const EARLIER_KEPT: usize = 20;

const LINK: u8 = b'l';
const REMOTE: u8 = b'r';
const CONTACT: u8 = b'u';

/// A service conversation at one desk.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeskLink {
    pub connector: String,
    pub conversation_id: String,
    /// The desk's conversation (Chatwoot: its display id), once opened.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<String>,
    /// The desk's contact of the end user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub contact: Option<String>,
    /// The handoff (its action id) that opened `remote`, or is opening it.
    pub opened_by: String,
    /// When the bridge handed the user back to the bot: nothing more goes into `remote`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub closed_at: Option<Millis>,
    /// The bridge-owned ids of what was posted into `remote`, newest last (at most
    /// [`POSTED_KEPT`]).
    #[serde(default, skip_serializing_if = "VecDeque::is_empty")]
    pub posted: VecDeque<String>,
    /// A call whose outcome is not known (it may have taken effect): looked for at the desk
    /// before it is made again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uncertain: Option<String>,
    /// Earlier desk conversations of this conversation (at most [`EARLIER_KEPT`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub earlier: Vec<String>,
    /// What else the connector keeps (its URL parts, the labels it set...).
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub extra: serde_json::Value,
    /// The daemon's time of the last change.
    pub updated_at: Millis,
}

impl DeskLink {
    /// Whether `id` was posted into the current desk conversation.
    pub fn was_posted(&self, id: &str) -> bool {
        self.posted.iter().any(|p| p == id)
    }

    /// Record `id` as posted (and no longer uncertain).
    pub fn posted(&mut self, id: &str) {
        if !self.was_posted(id) {
            self.posted.push_back(id.to_owned());
        }
        while self.posted.len() > POSTED_KEPT {
            self.posted.pop_front();
        }
        if self.uncertain.as_deref() == Some(id) {
            self.uncertain = None;
        }
    }

    /// A new desk conversation for the handoff `by`: the current one (if any) becomes an earlier
    /// one, and what was posted starts afresh.
    pub fn reopen(&mut self, by: &str) {
        if let Some(old) = self.remote.take() {
            self.earlier.push(old);
            if self.earlier.len() > EARLIER_KEPT {
                self.earlier.remove(0);
            }
        }
        self.opened_by = by.to_owned();
        self.closed_at = None;
        self.posted.clear();
        self.uncertain = None;
    }
}

/// An end user's contact at one desk.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeskContact {
    pub connector: String,
    /// The bridge's own identifier of the user at the desk.
    pub user: String,
    pub contact: String,
    /// What else the connector keeps (Chatwoot: the contact's source id per inbox).
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub extra: serde_json::Value,
    pub updated_at: Millis,
}

/// The desks' mappings, as a port group: a second backend keeps them too.
pub trait DeskLinks {
    /// The link of `conversation` at `connector`.
    fn desk_link(
        &self,
        connector: &str,
        conversation: &ConversationId,
    ) -> Result<Option<DeskLink>, StoreError>;
    /// Write a link, and index its desk conversations (current and earlier) back to it.
    fn put_desk_link(&self, link: &DeskLink) -> Result<(), StoreError>;
    /// The service conversation the desk's conversation `remote` belongs to, and its link (whose
    /// current `remote` may be another: then `remote` is an earlier one).
    fn desk_link_of_remote(
        &self,
        connector: &str,
        remote: &str,
    ) -> Result<Option<DeskLink>, StoreError>;
    fn desk_contact(&self, connector: &str, user: &str) -> Result<Option<DeskContact>, StoreError>;
    fn put_desk_contact(&self, contact: &DeskContact) -> Result<(), StoreError>;
    /// Remove at most `limit` links closed before `before` (with their index entries); how many.
    fn prune_desk_links(&self, before: Millis, limit: usize) -> Result<u64, StoreError>;
}

impl SledStore {
    pub(super) fn desk_links_tree(&self) -> Result<sled::Tree, StoreError> {
        Ok(self.db.open_tree(keys::tree::DESK_LINKS)?)
    }
}

impl DeskLinks for SledStore {
    fn desk_link(
        &self,
        connector: &str,
        conversation: &ConversationId,
    ) -> Result<Option<DeskLink>, StoreError> {
        let key = keys::desk_link(LINK, connector, conversation.as_str());
        match self.desk_links_tree()?.get(key)? {
            Some(v) => Ok(Some(decode(&v, "desk link")?)),
            None => Ok(None),
        }
    }

    fn put_desk_link(&self, link: &DeskLink) -> Result<(), StoreError> {
        let mut batch = sled::Batch::default();
        let conversation = link.conversation_id.as_bytes();
        for remote in link.remote.iter().chain(&link.earlier) {
            batch.insert(
                keys::desk_link(REMOTE, &link.connector, remote),
                conversation,
            );
        }
        batch.insert(
            keys::desk_link(LINK, &link.connector, &link.conversation_id),
            encode(link)?,
        );
        self.desk_links_tree()?.apply_batch(batch)?;
        Ok(())
    }

    fn desk_link_of_remote(
        &self,
        connector: &str,
        remote: &str,
    ) -> Result<Option<DeskLink>, StoreError> {
        let tree = self.desk_links_tree()?;
        let Some(conversation) = tree.get(keys::desk_link(REMOTE, connector, remote))? else {
            return Ok(None);
        };
        let conversation = String::from_utf8_lossy(&conversation).into_owned();
        self.desk_link(connector, &ConversationId::new(conversation))
    }

    fn desk_contact(&self, connector: &str, user: &str) -> Result<Option<DeskContact>, StoreError> {
        let key = keys::desk_link(CONTACT, connector, user);
        match self.desk_links_tree()?.get(key)? {
            Some(v) => Ok(Some(decode(&v, "desk contact")?)),
            None => Ok(None),
        }
    }

    fn put_desk_contact(&self, contact: &DeskContact) -> Result<(), StoreError> {
        let key = keys::desk_link(CONTACT, &contact.connector, &contact.user);
        self.desk_links_tree()?.insert(key, encode(contact)?)?;
        Ok(())
    }

    fn prune_desk_links(&self, before: Millis, limit: usize) -> Result<u64, StoreError> {
        let tree = self.desk_links_tree()?;
        let mut removed = 0;
        for item in tree.scan_prefix([LINK]) {
            if removed >= limit as u64 {
                break;
            }
            let (key, value) = item?;
            let Ok(link) = decode::<DeskLink>(&value, "desk link") else {
                continue;
            };
            if link.closed_at.is_none_or(|at| at >= before) || link.updated_at >= before {
                continue;
            }
            let mut batch = sled::Batch::default();
            for remote in link.remote.iter().chain(&link.earlier) {
                batch.remove(keys::desk_link(REMOTE, &link.connector, remote));
            }
            batch.remove(key);
            tree.apply_batch(batch)?;
            removed += 1;
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(conversation: &str, remote: &str) -> DeskLink {
        DeskLink {
            connector: "chatwoot".into(),
            conversation_id: conversation.into(),
            remote: Some(remote.into()),
            contact: Some("c9".into()),
            opened_by: "e1/tell-helpdesk/0".into(),
            updated_at: 10,
            ..DeskLink::default()
        }
    }

    #[test]
    fn posted_ids_are_bounded_and_an_uncertain_post_is_settled_when_posted() {
        let mut l = link("c1", "41");
        l.uncertain = Some("hb:m0".into());
        for i in 0..POSTED_KEPT + 5 {
            l.posted(&format!("hb:m{i}"));
        }
        assert_eq!(l.posted.len(), POSTED_KEPT);
        assert!(l.uncertain.is_none());
        assert!(l.was_posted(&format!("hb:m{}", POSTED_KEPT + 4)) && !l.was_posted("hb:m0"));
    }
}
