//! The desks' mappings (`DeskLinks`): links by (connector, conversation), the desk's
//! conversations back to theirs, contacts by (connector, user).

use crate::prepared::Prepared;
use crate::rows::{json, parse};
use crate::{PgError, PgStore};
use model::ids::ConversationId;
use model::webhook::model::Millis;
use storage::desk_links::{DeskContact, DeskLink, DeskLinks};
use storage::StoreError;

impl DeskLinks for PgStore {
    fn desk_link(
        &self,
        connector: &str,
        conversation: &ConversationId,
    ) -> Result<Option<DeskLink>, StoreError> {
        let (connector, id) = (connector.to_owned(), conversation.as_str().to_owned());
        self.with_client(move |c| async move {
            let row = c
                .row_opt(
                    "SELECT link FROM desk_links WHERE connector = $1 AND conversation = $2",
                    &[&connector, &id],
                )
                .await?;
            row.map(|r| parse(r.get(0), "desk link")).transpose()
        })
    }

    /// The link and its index entries in one transaction.
    fn put_desk_link(&self, link: &DeskLink) -> Result<(), StoreError> {
        let (link, active) = (link.clone(), self.active());
        let text = json(&link)?;
        self.with_client(move |mut c| async move {
            let tx = crate::begin_active(&mut c, &active).await?;
            let remotes: Vec<&str> = link.remote.iter().chain(&link.earlier).map(String::as_str).collect();
            tx.exec(
                "INSERT INTO desk_remotes (connector, remote, conversation) \
                 SELECT $1, r, $2 FROM unnest($3::text[]) AS r \
                 ON CONFLICT (connector, remote) DO UPDATE SET conversation = excluded.conversation",
                &[&link.connector, &link.conversation_id, &remotes],
            )
            .await?;
            tx.exec(
                "INSERT INTO desk_links (connector, conversation, closed_at, updated_at, link) \
                 VALUES ($1, $2, $3, $4, $5) ON CONFLICT (connector, conversation) DO UPDATE \
                 SET closed_at = excluded.closed_at, updated_at = excluded.updated_at, \
                 link = excluded.link",
                &[&link.connector, &link.conversation_id, &link.closed_at, &link.updated_at, &text],
            )
            .await?;
            tx.commit().await?;
            Ok(())
        })
    }

    fn desk_link_of_remote(
        &self,
        connector: &str,
        remote: &str,
    ) -> Result<Option<DeskLink>, StoreError> {
        let (connector, remote) = (connector.to_owned(), remote.to_owned());
        self.with_client(move |c| async move {
            let row = c
                .row_opt(
                    "SELECT l.link FROM desk_remotes r JOIN desk_links l \
                     ON l.connector = r.connector AND l.conversation = r.conversation \
                     WHERE r.connector = $1 AND r.remote = $2",
                    &[&connector, &remote],
                )
                .await?;
            row.map(|r| parse(r.get(0), "desk link")).transpose()
        })
    }

    fn desk_contact(&self, connector: &str, user: &str) -> Result<Option<DeskContact>, StoreError> {
        let (connector, user) = (connector.to_owned(), user.to_owned());
        self.with_client(move |c| async move {
            let row = c
                .row_opt(
                    "SELECT contact FROM desk_contacts WHERE connector = $1 AND user_id = $2",
                    &[&connector, &user],
                )
                .await?;
            row.map(|r| parse(r.get(0), "desk contact")).transpose()
        })
    }

    fn put_desk_contact(&self, contact: &DeskContact) -> Result<(), StoreError> {
        let (connector, user, text) = (
            contact.connector.clone(),
            contact.user.clone(),
            json(contact)?,
        );
        let active = self.active();
        self.with_client(move |mut c| async move {
            let tx = crate::begin_active(&mut c, &active).await?;
            tx.exec(
                "INSERT INTO desk_contacts (connector, user_id, contact) VALUES ($1, $2, $3) \
                 ON CONFLICT (connector, user_id) DO UPDATE SET contact = excluded.contact",
                &[&connector, &user, &text],
            )
            .await?;
            tx.commit().await?;
            Ok(())
        })
    }

    fn prune_desk_links(&self, before: Millis, limit: usize) -> Result<u64, StoreError> {
        let (limit, active) = (crate::rows::big(limit as u64), self.active());
        self.with_client(move |mut c| async move {
            let tx = crate::begin_active(&mut c, &active).await?;
            let rows = tx
                .rows(
                    "DELETE FROM desk_links WHERE (connector, conversation) IN \
                     (SELECT connector, conversation FROM desk_links \
                      WHERE closed_at < $1 AND updated_at < $1 LIMIT $2) \
                     RETURNING connector, conversation",
                    &[&before, &limit],
                )
                .await?;
            let connectors: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
            let conversations: Vec<String> = rows.iter().map(|r| r.get(1)).collect();
            tx.exec(
                "DELETE FROM desk_remotes r USING unnest($1::text[], $2::text[]) AS d(connector, conversation) \
                 WHERE r.connector = d.connector AND r.conversation = d.conversation",
                &[&connectors, &conversations],
            )
            .await?;
            tx.commit().await?;
            Ok::<u64, PgError>(rows.len() as u64)
        })
    }
}
