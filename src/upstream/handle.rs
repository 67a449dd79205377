//! A `Send + Clone` handle to the Open API client. awc's client is not `Send`, so the client
//! lives on a dedicated actix arbiter (a thread with its own runtime); calls travel to it over a
//! channel and each runs there as its own local task.

use super::client::{ApiCall, AttemptObserver, Client, ClientSettings, Execute};
use super::error::UpstreamError;
use super::limits::{Limits, LimitsConfig};
use super::transport::AwcTransport;
use serde_json::Value;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

type Request = (ApiCall, oneshot::Sender<Result<Value, UpstreamError>>);

#[derive(Clone)]
pub struct UpstreamHandle {
    tx: mpsc::UnboundedSender<Request>,
    _home: Arc<Home>,
}

/// Stops the arbiter when the last handle goes.
struct Home(actix_rt::Arbiter);

impl Drop for Home {
    fn drop(&mut self) {
        self.0.stop();
    }
}

/// Where and how to reach the upstream.
#[derive(Clone, Debug)]
pub struct Endpoint {
    pub base_url: String,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
}

impl UpstreamHandle {
    pub fn start(
        endpoint: Endpoint,
        settings: ClientSettings,
        limits: &LimitsConfig,
        observer: Option<AttemptObserver>,
    ) -> Result<Self, String> {
        let limits = Limits::new(limits)?;
        let (tx, mut rx) = mpsc::unbounded_channel::<Request>();
        let arbiter = actix_rt::Arbiter::new();
        let started = arbiter.spawn_fn(move || {
            let transport = AwcTransport::new(
                &endpoint.base_url,
                endpoint.connect_timeout,
                endpoint.request_timeout,
            );
            let client = Rc::new(Client::new(transport, settings, limits).with_observer(observer));
            actix_web::rt::spawn(async move {
                while let Some((call, reply)) = rx.recv().await {
                    let client = client.clone();
                    actix_web::rt::spawn(async move {
                        // The caller may have given up; its answer is then dropped.
                        let _ = reply.send(client.execute(call).await);
                    });
                }
            });
        });
        if !started {
            return Err("cannot start the upstream client thread".into());
        }
        Ok(UpstreamHandle {
            tx,
            _home: Arc::new(Home(arbiter)),
        })
    }
}

impl Execute for UpstreamHandle {
    async fn execute(&self, call: ApiCall) -> Result<Value, UpstreamError> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send((call, reply))
            .map_err(|_| UpstreamError::Stopped)?;
        answer.await.map_err(|_| UpstreamError::Stopped)?
    }
}
