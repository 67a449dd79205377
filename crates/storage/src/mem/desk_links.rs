//! The in-memory store's desk mappings (`DeskLinks`).

use super::MemStore;
use crate::desk_links::{DeskContact, DeskLink, DeskLinks};
use crate::StoreError;
use model::ids::ConversationId;
use model::webhook::model::Millis;

fn key(connector: &str, id: &str) -> (String, String) {
    (connector.to_owned(), id.to_owned())
}

impl DeskLinks for MemStore {
    fn desk_link(
        &self,
        connector: &str,
        conversation: &ConversationId,
    ) -> Result<Option<DeskLink>, StoreError> {
        let data = self.data();
        Ok(data
            .desk_links
            .get(&key(connector, conversation.as_str()))
            .cloned())
    }

    fn put_desk_link(&self, link: &DeskLink) -> Result<(), StoreError> {
        let mut data = self.data();
        self.fenced(&data)?;
        for remote in link.remote.iter().chain(&link.earlier) {
            let conversation = link.conversation_id.clone();
            data.desk_remotes
                .insert(key(&link.connector, remote), conversation);
        }
        let at = key(&link.connector, &link.conversation_id);
        data.desk_links.insert(at, link.clone());
        Ok(())
    }

    fn desk_link_of_remote(
        &self,
        connector: &str,
        remote: &str,
    ) -> Result<Option<DeskLink>, StoreError> {
        let data = self.data();
        let Some(conversation) = data.desk_remotes.get(&key(connector, remote)) else {
            return Ok(None);
        };
        Ok(data.desk_links.get(&key(connector, conversation)).cloned())
    }

    fn desk_contact(&self, connector: &str, user: &str) -> Result<Option<DeskContact>, StoreError> {
        Ok(self
            .data()
            .desk_contacts
            .get(&key(connector, user))
            .cloned())
    }

    fn put_desk_contact(&self, contact: &DeskContact) -> Result<(), StoreError> {
        let at = key(&contact.connector, &contact.user);
        let mut data = self.data();
        self.fenced(&data)?;
        data.desk_contacts.insert(at, contact.clone());
        Ok(())
    }

    fn prune_desk_links(&self, before: Millis, limit: usize) -> Result<u64, StoreError> {
        let mut data = self.data();
        self.fenced(&data)?;
        let gone: Vec<DeskLink> = data
            .desk_links
            .values()
            .filter(|l| l.closed_at.is_some_and(|at| at < before) && l.updated_at < before)
            .take(limit)
            .cloned()
            .collect();
        for link in &gone {
            // Only the entries still leading to this link (another may own one since).
            for remote in link.remote.iter().chain(&link.earlier) {
                let at = key(&link.connector, remote);
                if data.desk_remotes.get(&at) == Some(&link.conversation_id) {
                    data.desk_remotes.remove(&at);
                }
            }
            data.desk_links
                .remove(&key(&link.connector, &link.conversation_id));
        }
        Ok(gone.len() as u64)
    }
}
