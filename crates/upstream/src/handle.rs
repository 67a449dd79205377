//! A `Send + Clone` handle to the Open API client. awc's client is not `Send`, so the client
//! lives on a dedicated actix arbiter (a thread with its own runtime); calls travel to it over a
//! channel and each runs there as its own local task. The outbox's executor, the main caller,
//! runs on that thread too ([`UpstreamHandle::spawn_beside`]), so its calls cross no thread.

use super::client::{ApiCall, AttemptObserver, Client, ClientSettings, Execute};
use super::error::UpstreamError;
use super::limits::{Limits, LimitsConfig};
use super::transport::{AwcTransport, RawRequest, RawResponse, Transport, TransportError};
use serde_json::Value;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

type Request = (ApiCall, oneshot::Sender<Result<Value, UpstreamError>>);

#[derive(Clone)]
pub struct UpstreamHandle {
    tx: mpsc::UnboundedSender<Request>,
    home: Arc<Home>,
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
pub struct Remote {
    pub base_url: String,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
    /// How `https://` is verified, and who hears of a failed handshake.
    pub tls: crate::tls::ClientTls,
}

impl UpstreamHandle {
    pub fn start(
        endpoint: Remote,
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
                endpoint.tls,
            );
            let client = Rc::new(Client::new(transport, settings, limits).with_observer(observer));
            actix_rt::spawn(async move {
                while let Some((call, mut reply)) = rx.recv().await {
                    let client = client.clone();
                    actix_rt::spawn(async move {
                        tokio::select! {
                            answer = client.execute(call) => {
                                let _ = reply.send(answer);
                            }
                            // The caller gave up (its task was dropped: a node no longer the
                            // active one drops its calls): the call goes too, its connection
                            // closed.
                            () = reply.closed() => {}
                        }
                    });
                }
            });
        });
        if !started {
            return Err("cannot start the upstream client thread".into());
        }
        Ok(UpstreamHandle {
            tx,
            home: Arc::new(Home(arbiter)),
        })
    }

    /// Runs `task` on the client's thread, where a call reaches the client through a local
    /// channel instead of waking another thread and being woken back (two thread hops per call).
    /// The answer ends when the task does (or is dropped, as by a panic). Fails only if that
    /// thread has stopped.
    pub fn spawn_beside(
        &self,
        task: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<oneshot::Receiver<()>, String> {
        let (ended, finished) = oneshot::channel();
        let started = self.home.0.spawn(async move {
            task.await;
            let _ = ended.send(());
        });
        if !started {
            return Err("the upstream client thread has stopped".into());
        }
        Ok(finished)
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

type RawCall = (
    RawRequest,
    oneshot::Sender<Result<RawResponse, TransportError>>,
);

/// A `Send + Clone` face of a bare [`AwcTransport`], kept on its own arbiter like
/// [`UpstreamHandle`]: single HTTP exchanges without the Open API client's auth, rate limits and
/// retries, for callers that sign and retry their own way (the help-desk sender: one handle per
/// endpoint, each with its own TLS trust). Requests carry absolute URLs in `path` (the base is
/// empty).
#[derive(Clone)]
pub struct TransportHandle {
    tx: mpsc::UnboundedSender<RawCall>,
    _home: Arc<Home>,
}

impl TransportHandle {
    pub fn start(
        connect_timeout: Duration,
        request_timeout: Duration,
        tls: crate::tls::ClientTls,
    ) -> Result<Self, String> {
        let (tx, mut rx) = mpsc::unbounded_channel::<RawCall>();
        let arbiter = actix_rt::Arbiter::new();
        let started = arbiter.spawn_fn(move || {
            let transport = Rc::new(AwcTransport::new("", connect_timeout, request_timeout, tls));
            actix_rt::spawn(async move {
                while let Some((request, reply)) = rx.recv().await {
                    let transport = transport.clone();
                    actix_rt::spawn(async move {
                        let _ = reply.send(transport.send(request).await);
                    });
                }
            });
        });
        if !started {
            return Err("cannot start the HTTP client thread".into());
        }
        Ok(TransportHandle {
            tx,
            _home: Arc::new(Home(arbiter)),
        })
    }
}

impl Transport for TransportHandle {
    async fn send(&self, request: RawRequest) -> Result<RawResponse, TransportError> {
        let (reply, answer) = oneshot::channel();
        let stopped = || TransportError::Other("the HTTP client thread has stopped".into());
        self.tx.send((request, reply)).map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}
