//! Test helpers other crates' tests use too (feature `test-support`).

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

/// A CA and a leaf for `names` signed by it: (CA PEM, leaf PEM, leaf key PEM).
pub fn ca_and_leaf(names: &[&str]) -> (String, String, String) {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "handoff-bridge unit test CA");
    let ca =
        CertifiedIssuer::self_signed(ca_params, KeyPair::generate().expect("key")).expect("ca");
    let key = KeyPair::generate().expect("key");
    let leaf = CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())
        .expect("leaf params")
        .signed_by(&key, &ca)
        .expect("leaf");
    (ca.pem(), leaf.pem(), key.serialize_pem())
}
