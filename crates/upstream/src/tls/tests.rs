use super::*;
use crate::test_support::ca_and_leaf;
use rustls::CertificateError as C;

fn failure(e: rustls::Error) -> TlsReason {
    TlsFailure::from_rustls(&e).reason
}

#[test]
fn rustls_errors_map_to_a_small_set_of_reasons() {
    let cert = rustls::Error::InvalidCertificate;
    assert_eq!(failure(cert(C::UnknownIssuer)), TlsReason::UnknownIssuer);
    assert_eq!(failure(cert(C::Expired)), TlsReason::Expired);
    assert_eq!(failure(cert(C::NotValidYet)), TlsReason::NotYetValid);
    assert_eq!(failure(cert(C::NotValidForName)), TlsReason::NameMismatch);
    assert_eq!(failure(cert(C::BadSignature)), TlsReason::BadCertificate);
    assert_eq!(failure(cert(C::Revoked)), TlsReason::BadCertificate);
    assert_eq!(
        failure(rustls::Error::AlertReceived(
            rustls::AlertDescription::HandshakeFailure
        )),
        TlsReason::Handshake
    );
    let labels: std::collections::HashSet<&str> =
        TlsReason::ALL.iter().map(|r| r.label()).collect();
    assert_eq!(labels.len(), TlsReason::ALL.len(), "labels are distinct");
    // The labels are metric labels and dead-letter suffixes (`tls_<label>`): pinned.
    let pinned: Vec<&str> = TlsReason::ALL.iter().map(|r| r.label()).collect();
    assert_eq!(
        pinned,
        [
            "unknown_issuer",
            "expired",
            "not_yet_valid",
            "name_mismatch",
            "bad_certificate",
            "handshake"
        ]
    );
    let text = TlsFailure::from_rustls(&cert(C::UnknownIssuer)).to_string();
    assert!(
        text.contains("certificate not trusted") && text.contains("UnknownIssuer"),
        "{text}"
    );
}

#[test]
fn awc_connect_errors_are_searched_for_the_rustls_error_inside() {
    use awc::error::ConnectError;
    // What awc hands back for a failed handshake: its Io variant around tokio-rustls' io::Error.
    let handshake = ConnectError::Io(std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        rustls::Error::InvalidCertificate(C::Expired),
    ));
    assert_eq!(
        TlsFailure::from_connect_error(&handshake).map(|f| f.reason),
        Some(TlsReason::Expired)
    );
    let refused = ConnectError::Io(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
    assert_eq!(TlsFailure::from_connect_error(&refused), None);
    assert_eq!(TlsFailure::from_connect_error(&ConnectError::Timeout), None);
    assert_eq!(
        TlsFailure::from_connect_error(&ConnectError::NoRecords),
        None
    );
}

#[test]
fn a_ca_file_must_exist_and_hold_certificates() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (ca, leaf, key) = ca_and_leaf(&["localhost"]);
    let two = dir.path().join("two.pem");
    std::fs::write(&two, format!("{ca}{leaf}")).expect("write");
    assert_eq!(read_ca_file(&two).expect("two certificates").len(), 2);

    let missing = read_ca_file(&dir.path().join("missing.pem")).expect_err("missing");
    assert!(missing.contains("cannot read"), "{missing}");
    let only_key = dir.path().join("key.pem");
    std::fs::write(&only_key, &key).expect("write");
    let err = read_ca_file(&only_key).expect_err("a key is not a certificate");
    assert!(err.contains("no PEM certificate"), "{err}");
    assert!(
        !err.contains("PRIVATE KEY"),
        "the contents are never shown: {err}"
    );
    let empty = dir.path().join("empty.pem");
    std::fs::write(&empty, "").expect("write");
    assert!(read_ca_file(&empty).is_err());

    // A client config with the private CA builds; one with a bad file does not.
    let trust = Trust::empty();
    assert!(trust.client_config(two.to_str().expect("utf-8")).is_ok());
    assert!(trust
        .client_config(only_key.to_str().expect("utf-8"))
        .is_err());
}

#[test]
fn every_failed_handshake_is_counted_and_a_repeat_is_not_logged_as_new() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = seen.clone();
    let observer: TlsObserver = Arc::new(move |destination, failure| {
        record
            .lock()
            .expect("seen")
            .push((destination.to_owned(), failure.reason));
    });
    let tls = ClientTls::new(&Trust::empty(), "", "desk", Some(observer)).expect("client");
    let expired = TlsFailure::from_rustls(&rustls::Error::InvalidCertificate(C::Expired));
    let unknown = TlsFailure::from_rustls(&rustls::Error::InvalidCertificate(C::UnknownIssuer));
    let logged = || *tls.logged.lock().expect("logged");
    tls.failed(&expired);
    assert_eq!(logged(), Some(TlsReason::Expired));
    tls.failed(&expired);
    tls.failed(&unknown);
    assert_eq!(
        logged(),
        Some(TlsReason::UnknownIssuer),
        "a new reason is logged anew"
    );
    tls.succeeded();
    assert_eq!(
        logged(),
        None,
        "after a success the next failure is logged again"
    );
    assert_eq!(
        *seen.lock().expect("seen"),
        [
            ("desk".to_owned(), TlsReason::Expired),
            ("desk".to_owned(), TlsReason::Expired),
            ("desk".to_owned(), TlsReason::UnknownIssuer),
        ],
        "every failure is counted"
    );
}
