//! The Chatwoot connector (docs/chatwoot.md): a handoff opens a conversation in a Chatwoot API
//! inbox, the user's messages follow it there, and the agents' replies, assignments and resolves
//! come back through Chatwoot's signed webhook as agent commands.
//!
//! - Outbound ([`outbound`], [`client`]): a [`DeskTarget`] (destination `chatwoot`) that turns
//!   each desk event into account-API calls, its progress kept in the mappings
//!   (`storage::desk_links`) so every call is made once across retries and crashes.
//! - Inbound ([`webhook`], [`payload`], [`signature`]): `POST /helpdesk/chatwoot/webhook`,
//!   verified, its events turned into `agent.*` commands of the mapped conversation on the one
//!   command path ([`crate::helpdesk::commands`]), stored before the 200.
//! - [`health`]: how the last call found Chatwoot (the console's overview).

pub mod client;
pub mod health;
pub mod inbound;
pub mod outbound;
#[cfg(test)]
mod outbound_tests;
pub mod payload;
pub mod signature;
pub mod webhook;

use crate::config::chatwoot::ChatwootConfig;
use crate::helpdesk::port::{DeskError, DeskEvent, DeskTarget};
use crate::ops::metrics::Metrics;
use client::{Api, NAME};
use futures_util::future::BoxFuture;
use health::Health;
use model::helpdesk::DeskEventKind;
use std::sync::{Arc, OnceLock};
use upstream::handle::TransportHandle;

/// The connector's outbound side.
pub struct Chatwoot {
    api: Api,
    config: ChatwootConfig,
    store: storage::Store,
    /// The daemon's writer, once it runs ([`ChatwootView::attach`]): the mark of a call that may
    /// take effect is made durable through it (the one flusher) before the call.
    writer: Writer,
}

/// The writer, attached once the pipeline has one (it starts after the help desks).
type Writer = Arc<OnceLock<storage::Writer>>;

/// What the rest of the daemon sees of the connector: its health and where its conversations
/// are shown (the console).
#[derive(Clone)]
pub struct ChatwootView {
    pub health: Arc<Health>,
    /// `{url}/app/accounts/{account_id}/conversations/`.
    conversations_url: String,
    writer: Writer,
}

impl ChatwootView {
    /// The agent's view of Chatwoot's conversation `display_id`.
    pub fn conversation_url(&self, display_id: &str) -> String {
        format!("{}{display_id}", self.conversations_url)
    }

    /// Give the connector the daemon's writer (before the executor runs; until then a call that
    /// needs a durable mark waits as if the store were busy).
    pub fn attach(&self, writer: storage::Writer) {
        if self.writer.set(writer).is_err() {
            tracing::error!("the Chatwoot connector was given a writer twice; the first is kept");
        }
    }
}

impl Chatwoot {
    /// From the validated `[helpdesk.chatwoot]` (its token resolved): its own HTTP client
    /// thread, trusting the platform's roots and its `ca_file`.
    pub fn start(
        helpdesk: &crate::config::HelpdeskConfig,
        (trust, observer): (&upstream::tls::Trust, Option<upstream::tls::TlsObserver>),
        store: storage::Store,
        metrics: Metrics,
    ) -> Result<(Arc<Chatwoot>, ChatwootView), String> {
        let config = &helpdesk.chatwoot;
        let token = config.resolve_api_token()?;
        let tls = upstream::tls::ClientTls::new(trust, &config.ca_file, NAME, observer)
            .map_err(|e| format!("helpdesk.chatwoot.ca_file: {e}"))?;
        let http = TransportHandle::start(helpdesk.connect_timeout, helpdesk.timeout, tls)?;
        let health = Arc::new(Health::default());
        let writer = Writer::default();
        let api = Api::new(
            &config.url,
            config.account_id,
            token,
            http,
            (metrics, health.clone()),
        );
        let view = ChatwootView {
            health,
            conversations_url: format!(
                "{}/app/accounts/{}/conversations/",
                config.url, config.account_id
            ),
            writer: writer.clone(),
        };
        let chatwoot = Chatwoot {
            api,
            config: config.clone(),
            store,
            writer,
        };
        Ok((Arc::new(chatwoot), view))
    }
}

impl DeskTarget for Chatwoot {
    fn name(&self) -> &str {
        NAME
    }

    fn destination(&self) -> String {
        NAME.to_owned()
    }

    fn reason_prefix(&self) -> &'static str {
        NAME
    }

    fn takes(&self, _kind: DeskEventKind) -> bool {
        true
    }

    fn ready(&self) -> bool {
        true
    }

    fn deliver<'a>(
        &'a self,
        event: &'a DeskEvent,
        again: bool,
    ) -> BoxFuture<'a, Result<(), DeskError>> {
        Box::pin(self.carry_out(event, again))
    }
}
