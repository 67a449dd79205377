//! A TCP forwarder on a loopback port of its own, in front of an upstream: `close` stops
//! listening and cuts every connection it carries (a daemon then meets "connection refused", and
//! its pooled connections die too), `open` listens on the same port again. Threads of the test
//! process, stopped when it is closed or dropped.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

pub struct Forwarder {
    addr: SocketAddr,
    target: SocketAddr,
    running: Option<Running>,
}

struct Running {
    stop: Arc<AtomicBool>,
    accept: JoinHandle<()>,
    /// Both ends of every connection carried, to cut them on close.
    streams: Arc<Mutex<Vec<TcpStream>>>,
}

impl Forwarder {
    /// Listening on a free loopback port, forwarding to `target`.
    pub fn start(target: SocketAddr) -> Forwarder {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the forwarder");
        let addr = listener.local_addr().expect("forwarder address");
        let mut fwd = Forwarder {
            addr,
            target,
            running: None,
        };
        fwd.run(listener);
        fwd
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn is_open(&self) -> bool {
        self.running.is_some()
    }

    /// Listen on the same port again (Rust's listener sets `SO_REUSEADDR`, so connections the
    /// close left in TIME_WAIT do not stop it).
    pub fn open(&mut self) {
        if self.running.is_some() {
            return;
        }
        let listener = TcpListener::bind(self.addr)
            .unwrap_or_else(|e| panic!("listen on {} again: {e}", self.addr));
        self.run(listener);
    }

    /// Stop listening (a connect is refused from now on) and cut every connection.
    pub fn close(&mut self) {
        if !self.shut() {
            return;
        }
        // Nothing listens now: a connect must be refused.
        assert!(
            TcpStream::connect(self.addr).is_err(),
            "{} still accepts connections",
            self.addr
        );
    }

    /// Stop the accept thread and cut the connections; false when it was closed already.
    fn shut(&mut self) -> bool {
        let Some(running) = self.running.take() else {
            return false;
        };
        running.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept; it sees the flag and returns, dropping the listener.
        let _ = TcpStream::connect(self.addr);
        let _ = running.accept.join();
        for s in running.streams.lock().expect("streams").drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
        true
    }

    fn run(&mut self, listener: TcpListener) {
        let stop = Arc::new(AtomicBool::new(false));
        let streams: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let target = self.target;
        let accept = {
            let (stop, streams) = (stop.clone(), streams.clone());
            std::thread::spawn(move || {
                for client in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(client) = client else { continue };
                    let Ok(server) = TcpStream::connect(target) else {
                        continue;
                    };
                    let mut list = streams.lock().expect("streams");
                    // Forget connections both sides have closed (a cut one errors on shutdown).
                    list.retain(|s| s.peer_addr().is_ok());
                    for s in [&client, &server] {
                        if let Ok(clone) = s.try_clone() {
                            list.push(clone);
                        }
                    }
                    drop(list);
                    pipe(&client, &server);
                    pipe(&server, &client);
                }
            })
        };
        self.running = Some(Running {
            stop,
            accept,
            streams,
        });
    }
}

/// Copy `from` to `to` on a thread until either end closes, then close both.
fn pipe(from: &TcpStream, to: &TcpStream) {
    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else {
        return;
    };
    std::thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = from.shutdown(Shutdown::Both);
        let _ = to.shutdown(Shutdown::Both);
    });
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.shut();
    }
}
