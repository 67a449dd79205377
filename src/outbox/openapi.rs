//! The Open API sink: navigations by flow title resolved through each bot's flow list (cached
//! until the fold records a newer event of the bot), one call per attempt, the answer judged
//! transient or permanent.

use super::sink::{judge_upstream, upstream_status, Attempt, Job, Reach, Report, Sink, OPENAPI};
use futures_util::future::BoxFuture;
use model::action::{Action, OutboxEntry};
use model::contract::Flow;
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use storage::Store;
use upstream::api::OpenApi;
use upstream::error::UpstreamError;
use upstream::execute::{execute, flow_title_bot, resolve_flow, ExecuteError};
use upstream::handle::UpstreamHandle;

pub struct OpenApiSink {
    api: OpenApi<UpstreamHandle>,
    store: Store,
    /// Each bot's flow list, for navigations by flow title.
    flows: Mutex<HashMap<String, BotFlows>>,
}

/// A bot's flow list as fetched, with the bot's `events_applied` then: a bot event folded since
/// (`bot.updated`, sent when flows change) makes it stale.
struct BotFlows {
    seen: u64,
    flows: Arc<Vec<Flow>>,
}

impl OpenApiSink {
    pub fn new(api: OpenApi<UpstreamHandle>, store: Store) -> Self {
        OpenApiSink {
            api,
            store,
            flows: Mutex::new(HashMap::new()),
        }
    }

    /// The action as it is called: a navigation by flow title gets its flow id from the bot's
    /// flow list (cached per bot until the fold records a newer event of the bot).
    async fn resolved<'a>(&self, action: &'a Action) -> Result<Cow<'a, Action>, ExecuteError> {
        let Some(bot) = flow_title_bot(action) else {
            return Ok(Cow::Borrowed(action));
        };
        let Some(bot) = bot else {
            return resolve_flow(action, &[]).map(Cow::Owned);
        };
        // A store that cannot be read leaves the cache alone: the list is fetched for this call.
        let seen = match self.store.bot(bot.as_str()) {
            Ok(state) => Some(state.map_or(0, |b| b.events_applied)),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the bot's state; fetching its flows");
                None
            }
        };
        let cached = seen.and_then(|seen| {
            let flows = self.flows.lock().unwrap_or_else(|e| e.into_inner());
            flows
                .get(bot.as_str())
                .filter(|cached| cached.seen == seen)
                .map(|cached| cached.flows.clone())
        });
        let list = match cached {
            Some(list) => list,
            None => {
                let list = Arc::new(self.api.list_flows(bot.as_str()).await?.data);
                if let Some(seen) = seen {
                    let fetched = BotFlows {
                        seen,
                        flows: list.clone(),
                    };
                    self.flows
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(bot.as_str().to_owned(), fetched);
                }
                list
            }
        };
        resolve_flow(action, &list).map(Cow::Owned)
    }

    async fn run(&self, entry: &OutboxEntry) -> Report {
        let result = match self.resolved(&entry.action).await {
            Ok(action) => execute(&self.api, &action, entry.key()).await,
            Err(e) => Err(e),
        };
        match result {
            Ok(_) => {
                let mut r = Report::delivered();
                r.reached.push((OPENAPI.into(), Reach::Answered));
                r
            }
            Err(e) => {
                let status = upstream_status(&e);
                match judge_upstream(e) {
                    Ok((dead, reached)) => {
                        let mut r = Report::new(Attempt::Dead(dead), status);
                        if reached {
                            r.reached.push((OPENAPI.into(), Reach::Answered));
                        }
                        r
                    }
                    Err(super::sink::Transient::Upstream(UpstreamError::Stopped)) => {
                        let mut r = Report::new(Attempt::Stopped, status);
                        r.attempted = false;
                        r
                    }
                    Err(failure) => {
                        let mut r = Report::new(
                            Attempt::Retry {
                                after: failure.retry_after(),
                                failure,
                            },
                            status,
                        );
                        r.reached.push((OPENAPI.into(), Reach::Failed));
                        r
                    }
                }
            }
        }
    }
}

impl Sink for OpenApiSink {
    fn destinations(&self, _entry: &OutboxEntry) -> Vec<String> {
        vec![OPENAPI.to_owned()]
    }

    fn attempt<'a>(&'a self, job: &'a Job) -> BoxFuture<'a, Report> {
        Box::pin(self.run(&job.entry))
    }
}
