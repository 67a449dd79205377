//! The desks' mappings (`desk_links/v1`), a port group of its own ([`DeskLinks`]): for each
//! connector, a service conversation's conversation at the desk (and how far the bridge got
//! opening and filling it), the desk's conversation back to the service's (its webhook names
//! only its own), and the desk's contact of an end user. Connectors write them as they go, so a
//! retry after a crash or an uncertain failure resumes instead of doing a call twice.
//!
//! Keys (`keys::desk_link`): `l` connector, conversation -> [`DeskLink`]; `r` connector, the
//! desk's conversation -> the service's conversation id; `u` connector, end user -> a
//! [`DeskContact`]; `c` the time a link was closed (u64 BE), connector, conversation -> nothing
//! (the pruning pass reads the closed links oldest first, not every link). A link and its `r` and
//! `c` entries are written in one batch; a `c` entry whose link was opened or closed again since
//! is stale, and dropped when the pass reaches it. Opened by name on use (sled keeps opened
//! trees), not kept in [`SledStore`].

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
const CLOSED: u8 = b'c';
/// Set once the `c` index holds every closed link (stores written before it had none).
const CLOSED_INDEXED: &[u8] = b"m\0closed-index";

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
        self.forget_remote();
        self.opened_by = by.to_owned();
        self.closed_at = None;
    }

    /// The current desk conversation (if any) becomes an earlier one (the desk no longer has it,
    /// or another handoff opens its own): nothing is posted into it again.
    pub fn forget_remote(&mut self) {
        if let Some(old) = self.remote.take() {
            self.earlier.retain(|e| *e != old);
            self.earlier.push(old);
            if self.earlier.len() > EARLIER_KEPT {
                self.earlier.remove(0);
            }
        }
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
        if let Some(at) = link.closed_at {
            batch.insert(closed_key(at, &link.connector, &link.conversation_id), &[]);
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
        index_closed(&tree)?;
        let mut removed = 0;
        for item in tree.scan_prefix([CLOSED, 0]) {
            if removed >= limit as u64 {
                break;
            }
            let (key, _) = item?;
            let Some((at, connector, conversation)) = parse_closed_key(&key) else {
                tree.remove(&key)?;
                continue;
            };
            if at >= before {
                break;
            }
            let link = self.desk_link(&connector, &ConversationId::new(conversation))?;
            match link {
                // Still wanted (changed since it closed): kept, and looked at again next time.
                Some(l) if l.closed_at == Some(at) && l.updated_at >= before => {}
                Some(l) if l.closed_at == Some(at) => {
                    remove_link(&tree, &l, &key)?;
                    removed += 1;
                }
                // Opened or closed again since, or gone: a stale entry.
                _ => {
                    tree.remove(&key)?;
                }
            }
        }
        Ok(removed)
    }
}

/// A closed link's `c` entry: the time it closed, its connector and conversation.
fn closed_key(at: Millis, connector: &str, conversation: &str) -> Vec<u8> {
    let at = u64::try_from(at).unwrap_or(0).to_be_bytes();
    [
        &[CLOSED, 0][..],
        &at,
        connector.as_bytes(),
        &[0],
        conversation.as_bytes(),
    ]
    .concat()
}

fn parse_closed_key(key: &[u8]) -> Option<(Millis, String, String)> {
    let at = key.get(2..10)?;
    let at = Millis::try_from(u64::from_be_bytes(at.try_into().ok()?)).ok()?;
    let rest = std::str::from_utf8(key.get(10..)?).ok()?;
    let (connector, conversation) = rest.split_once('\0')?;
    Some((at, connector.to_owned(), conversation.to_owned()))
}

/// A store written before the `c` index: every closed link indexed, once.
fn index_closed(tree: &sled::Tree) -> Result<(), StoreError> {
    if tree.contains_key(CLOSED_INDEXED)? {
        return Ok(());
    }
    for item in tree.scan_prefix([LINK, 0]) {
        let (_, value) = item?;
        let Ok(link) = decode::<DeskLink>(&value, "desk link") else {
            continue;
        };
        if let Some(at) = link.closed_at {
            tree.insert(closed_key(at, &link.connector, &link.conversation_id), &[])?;
        }
    }
    tree.insert(CLOSED_INDEXED, &[])?;
    Ok(())
}

/// A pruned link, its `c` entry, and the `r` entries that still lead to it (another link may
/// own a desk conversation since: Chatwoot's `lock_to_single_conversation` answers a contact's
/// last one).
fn remove_link(tree: &sled::Tree, link: &DeskLink, closed: &[u8]) -> Result<(), StoreError> {
    let own = link.conversation_id.as_bytes();
    for remote in link.remote.iter().chain(&link.earlier) {
        let key = keys::desk_link(REMOTE, &link.connector, remote);
        // Only if it is still this link's; another's is left alone.
        let _ = tree.compare_and_swap(key, Some(own), None as Option<&[u8]>)?;
    }
    let mut batch = sled::Batch::default();
    batch.remove(keys::desk_link(
        LINK,
        &link.connector,
        &link.conversation_id,
    ));
    batch.remove(closed);
    tree.apply_batch(batch)?;
    Ok(())
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

    const LINK_OWNER: &str = "chatwoot";

    fn store(dir: &tempfile::TempDir) -> SledStore {
        SledStore::open(dir.path(), 8 << 20).expect("open")
    }

    fn closed(conversation: &str, remote: &str, at: Millis) -> DeskLink {
        DeskLink {
            closed_at: Some(at),
            updated_at: at,
            ..link(conversation, remote)
        }
    }

    #[test]
    fn a_pruned_link_leaves_alone_the_desk_conversation_another_link_now_owns() {
        let dir = tempfile::tempdir().expect("tmp");
        let store = store(&dir);
        store.put_desk_link(&closed("c1", "41", 5)).expect("put");
        // Chatwoot answered c2's create with c1's conversation (lock_to_single_conversation).
        store.put_desk_link(&link("c2", "41")).expect("put");
        assert_eq!(store.prune_desk_links(11, 10).expect("prune"), 1);
        assert_eq!(
            store.desk_link(LINK_OWNER, &"c1".into()).expect("get"),
            None
        );
        let owner = store.desk_link_of_remote(LINK_OWNER, "41").expect("get");
        assert_eq!(owner.map(|l| l.conversation_id), Some("c2".to_owned()));
    }

    #[test]
    fn the_pass_reads_closed_links_by_time_and_drops_stale_entries() {
        let dir = tempfile::tempdir().expect("tmp");
        let store = store(&dir);
        // Closed at 5, then opened again for another handoff: its entry at 5 is stale.
        let mut reopened = closed("c1", "41", 5);
        store.put_desk_link(&reopened).expect("put");
        reopened.reopen("e2/tell-helpdesk/0");
        reopened.remote = Some("42".into());
        store.put_desk_link(&reopened).expect("put");
        store.put_desk_link(&closed("c2", "43", 6)).expect("put");
        // Closed before the cutoff but changed after it: kept.
        let mut busy = closed("c3", "44", 7);
        busy.updated_at = 20;
        store.put_desk_link(&busy).expect("put");
        store.put_desk_link(&closed("c4", "45", 30)).expect("put");
        assert_eq!(store.prune_desk_links(11, 10).expect("prune"), 1);
        let left = |c: &str| store.desk_link(LINK_OWNER, &c.into()).expect("get");
        assert!(left("c1").is_some() && left("c2").is_none());
        assert!(left("c3").is_some() && left("c4").is_some());
        let tree = store.desk_links_tree().expect("tree");
        let entries: Vec<_> = tree
            .scan_prefix([CLOSED, 0])
            .filter_map(|i| i.ok().and_then(|(k, _)| parse_closed_key(&k)))
            .map(|(at, _, c)| (at, c))
            .collect();
        assert_eq!(entries, [(7, "c3".to_owned()), (30, "c4".to_owned())]);
    }

    #[test]
    fn a_store_written_before_the_index_has_its_closed_links_indexed_once() {
        let dir = tempfile::tempdir().expect("tmp");
        let store = store(&dir);
        let old = closed("c1", "41", 5);
        let tree = store.desk_links_tree().expect("tree");
        let key = keys::desk_link(LINK, &old.connector, &old.conversation_id);
        tree.insert(key, encode(&old).expect("encode"))
            .expect("insert");
        assert_eq!(store.prune_desk_links(11, 10).expect("prune"), 1);
        assert!(tree.contains_key(CLOSED_INDEXED).expect("marker"));
        assert_eq!(
            store.desk_link_of_remote(LINK_OWNER, "41").expect("get"),
            None
        );
    }
}
